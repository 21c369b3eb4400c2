use super::*;
use proptest::prelude::*;
use uuid::Uuid;

fn sample() -> Envelope {
    Envelope {
        delivery_id: DeliveryId::new(),
        reminder_id: ReminderId::new(),
        tenant_id: TenantId::new(),
        channel: Channel::Sms,
        generation: 3,
        lane: Lane::Retry,
        correlation_id: "corr-0190f3e4".to_owned(),
        enqueued_at: DateTime::from_timestamp(1_790_000_000, 123_456_789).unwrap(),
    }
}

fn raw(envelope: &Envelope) -> pb::DeliveryEnvelope {
    pb::DeliveryEnvelope::decode(envelope.encode().as_slice()).unwrap()
}

fn decode_raw(raw: &pb::DeliveryEnvelope) -> Result<Envelope, EnvelopeError> {
    Envelope::decode(&raw.encode_to_vec())
}

fn assert_invalid(result: Result<Envelope, EnvelopeError>, expected_field: &str) {
    match result {
        Err(e @ EnvelopeError::InvalidField { field, .. }) => {
            assert_eq!(field, expected_field);
            assert_eq!(e.reason_code(), "invalid_field");
        }
        other => panic!("expected InvalidField({expected_field}), got {other:?}"),
    }
}

#[test]
fn an_envelope_decodes_to_what_was_encoded() {
    let envelope = sample();
    assert_eq!(Envelope::decode(&envelope.encode()).unwrap(), envelope);
}

#[test]
fn an_encoded_envelope_carries_the_current_schema_version() {
    assert_eq!(raw(&sample()).schema_version, SCHEMA_VERSION);
    assert_eq!(SCHEMA_VERSION, 1);
}

#[test]
fn an_encoded_envelope_holds_only_the_listed_fields() {
    let envelope = sample();
    let bytes = envelope.encode();
    let decoded = pb::DeliveryEnvelope::decode(bytes.as_slice()).unwrap();
    // prost drops unknown fields, so any extra byte would make the re-encoding shorter.
    assert_eq!(decoded.encode_to_vec(), bytes);
    assert_eq!(
        decoded,
        pb::DeliveryEnvelope {
            schema_version: 1,
            delivery_id: envelope.delivery_id.to_string(),
            reminder_id: envelope.reminder_id.to_string(),
            tenant_id: envelope.tenant_id.to_string(),
            channel: pb::Channel::Sms as i32,
            generation: 3,
            lane: pb::Lane::Retry as i32,
            correlation_id: "corr-0190f3e4".to_owned(),
            enqueued_at: Some(prost_types::Timestamp {
                seconds: 1_790_000_000,
                nanos: 123_456_789,
            }),
        }
    );
    // And the top-level tags on the wire are exactly 1..=9, each once.
    let mut tags = Vec::new();
    let mut rest = bytes.as_slice();
    while !rest.is_empty() {
        let key = prost::encoding::decode_varint(&mut rest).unwrap();
        let wire_type = key & 0x7;
        tags.push(key >> 3);
        match wire_type {
            0 => {
                prost::encoding::decode_varint(&mut rest).unwrap();
            }
            2 => {
                let len =
                    usize::try_from(prost::encoding::decode_varint(&mut rest).unwrap()).unwrap();
                rest = &rest[len..];
            }
            other => panic!("unexpected wire type {other}"),
        }
    }
    assert_eq!(tags, (1..=9).collect::<Vec<u64>>());
}

#[test]
fn a_newer_schema_version_is_refused_before_anything_else() {
    let mut r = raw(&sample());
    r.schema_version = 2;
    r.delivery_id = "garbage".to_owned();
    let err = decode_raw(&r).unwrap_err();
    assert!(
        matches!(err, EnvelopeError::UnsupportedSchemaVersion(2)),
        "{err:?}"
    );
    assert_eq!(err.reason_code(), "unsupported_schema_version");
}

#[test]
fn a_missing_schema_version_reads_as_zero_and_is_refused() {
    let mut r = raw(&sample());
    r.schema_version = 0;
    assert!(matches!(
        decode_raw(&r),
        Err(EnvelopeError::UnsupportedSchemaVersion(0))
    ));
}

#[test]
fn an_unspecified_channel_is_an_invalid_field() {
    let mut r = raw(&sample());
    r.channel = pb::Channel::Unspecified as i32;
    assert_invalid(decode_raw(&r), "channel");
}

#[test]
fn an_unknown_channel_number_is_an_invalid_field() {
    let mut r = raw(&sample());
    r.channel = 42;
    assert_invalid(decode_raw(&r), "channel");
}

#[test]
fn an_unspecified_or_unknown_lane_is_an_invalid_field() {
    for lane in [pb::Lane::Unspecified as i32, 9] {
        let mut r = raw(&sample());
        r.lane = lane;
        assert_invalid(decode_raw(&r), "lane");
    }
}

type SetField = fn(&mut pb::DeliveryEnvelope, String);

#[test]
fn a_malformed_id_is_an_invalid_field_naming_that_id_but_not_its_value() {
    let cases: [(&str, SetField); 3] = [
        ("delivery_id", |r, v| r.delivery_id = v),
        ("reminder_id", |r, v| r.reminder_id = v),
        ("tenant_id", |r, v| r.tenant_id = v),
    ];
    for (field, set) in cases {
        for bad in ["", "secret-not-a-uuid"] {
            let mut r = raw(&sample());
            set(&mut r, bad.to_owned());
            let result = decode_raw(&r);
            if let Err(e) = &result {
                assert!(!e.to_string().contains("secret"), "{e}");
            }
            assert_invalid(result, field);
        }
    }
}

#[test]
fn a_correlation_id_must_be_1_to_128_printable_ascii_characters() {
    for ok in ["a".to_owned(), "a".repeat(128), "x-Y_z:0/9".to_owned()] {
        let mut r = raw(&sample());
        r.correlation_id.clone_from(&ok);
        assert_eq!(decode_raw(&r).unwrap().correlation_id, ok);
    }
    for bad in [
        String::new(),
        "a".repeat(129),
        "has space".to_owned(),
        "new\nline".to_owned(),
        "é".to_owned(),
    ] {
        let mut r = raw(&sample());
        r.correlation_id = bad;
        assert_invalid(decode_raw(&r), "correlation_id");
    }
}

#[test]
fn a_missing_or_impossible_timestamp_is_an_invalid_field() {
    let bad = [
        None,
        Some(prost_types::Timestamp {
            seconds: 0,
            nanos: -1,
        }),
        Some(prost_types::Timestamp {
            seconds: 0,
            nanos: 1_000_000_000,
        }),
        Some(prost_types::Timestamp {
            seconds: i64::MAX,
            nanos: 0,
        }),
    ];
    for ts in bad {
        let mut r = raw(&sample());
        r.enqueued_at = ts;
        assert_invalid(decode_raw(&r), "enqueued_at");
    }
}

#[test]
fn truncated_bytes_are_undecodable() {
    let bytes = sample().encode();
    let err = Envelope::decode(&bytes[..bytes.len() - 3]).unwrap_err();
    assert!(matches!(err, EnvelopeError::Undecodable(_)), "{err:?}");
    assert_eq!(err.reason_code(), "undecodable");
    assert!(std::error::Error::source(&err).is_some());
}

#[test]
fn empty_bytes_decode_to_version_zero_and_are_refused() {
    assert!(matches!(
        Envelope::decode(&[]),
        Err(EnvelopeError::UnsupportedSchemaVersion(0))
    ));
}

#[test]
fn a_leap_second_is_written_as_the_last_nanosecond_before_it() {
    let mut envelope = sample();
    // chrono only represents a leap second in the 59th second of a minute.
    envelope.enqueued_at = DateTime::from_timestamp(1_790_000_039, 1_500_000_000).unwrap();
    let decoded = Envelope::decode(&envelope.encode()).unwrap();
    assert_eq!(
        decoded.enqueued_at,
        DateTime::from_timestamp(1_790_000_039, 999_999_999).unwrap()
    );
}

fn any_channel() -> impl Strategy<Value = Channel> {
    prop::sample::select(Channel::ALL.to_vec())
}

fn any_lane() -> impl Strategy<Value = Lane> {
    prop::sample::select(Lane::ALL.to_vec())
}

prop_compose! {
    fn any_envelope()(
        d in any::<[u8; 16]>(),
        r in any::<[u8; 16]>(),
        t in any::<[u8; 16]>(),
        channel in any_channel(),
        generation in any::<u64>(),
        lane in any_lane(),
        correlation_id in "[!-~]{1,128}",
        // Years 0001..=9999, the range a protobuf Timestamp allows.
        seconds in -62_135_596_800i64..=253_402_300_799,
        nanos in 0u32..1_000_000_000,
    ) -> Envelope {
        Envelope {
            delivery_id: DeliveryId::from_uuid(Uuid::from_bytes(d)),
            reminder_id: ReminderId::from_uuid(Uuid::from_bytes(r)),
            tenant_id: TenantId::from_uuid(Uuid::from_bytes(t)),
            channel,
            generation,
            lane,
            correlation_id,
            enqueued_at: DateTime::from_timestamp(seconds, nanos).unwrap(),
        }
    }
}

proptest! {
    #[test]
    fn any_valid_envelope_round_trips(envelope in any_envelope()) {
        prop_assert_eq!(Envelope::decode(&envelope.encode()).unwrap(), envelope);
    }

    #[test]
    fn arbitrary_bytes_are_refused_with_an_error_and_never_a_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        // Random bytes can, rarely, be a valid envelope; anything else must be a typed error.
        if let Err(e) = Envelope::decode(&bytes) {
            prop_assert!(["undecodable", "unsupported_schema_version", "invalid_field"].contains(&e.reason_code()));
        }
    }

    #[test]
    fn a_corrupted_envelope_is_refused_with_the_reason_of_its_corruption(
        envelope in any_envelope(),
        at in any::<prop::sample::Index>(),
        corruption in 0u8..3,
        version in 2u8..128,
        bad in b'g'..=b'z',
    ) {
        let mut bytes = envelope.encode();
        // Field 1 (schema_version) is written first: tag byte 0x08, then its value.
        prop_assert_eq!(&bytes[..2], &[0x08, 0x01]);
        let id = envelope.delivery_id.to_string();
        let id_at = bytes
            .windows(id.len())
            .position(|w| w == id.as_bytes())
            .unwrap();
        let i = id_at + at.index(id.len());
        match corruption {
            0 => {
                bytes[1] = version;
                let err = Envelope::decode(&bytes).unwrap_err();
                prop_assert!(matches!(err, EnvelopeError::UnsupportedSchemaVersion(v) if v == u32::from(version)), "{err:?}");
                prop_assert_eq!(err.reason_code(), "unsupported_schema_version");
            }
            1 => {
                // Not a hex digit or a dash: the id no longer parses.
                bytes[i] = bad;
                let err = Envelope::decode(&bytes).unwrap_err();
                prop_assert!(matches!(err, EnvelopeError::InvalidField { field: "delivery_id", .. }), "{err:?}");
                prop_assert_eq!(err.reason_code(), "invalid_field");
                prop_assert!(!err.to_string().contains(&id[..8]), "the error shows the id: {err}");
            }
            _ => {
                // Cut inside the id: its length prefix promises more than there is.
                bytes.truncate(i);
                let err = Envelope::decode(&bytes).unwrap_err();
                prop_assert!(matches!(err, EnvelopeError::Undecodable(_)), "{err:?}");
                prop_assert_eq!(err.reason_code(), "undecodable");
            }
        }
    }
}
