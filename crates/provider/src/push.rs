//! What the push adapters ([`crate::fcm`], [`crate::apns`]) share: the reminder's content as a
//! notification and its data, `Retry-After` read from an answer, and their answers built as
//! [`ProviderAnswer`]s with a code that is one of the provider's documented ones.

use nudge_domain::{ProviderAnswer, Verdict};

/// An answer with a status and the provider's code (`None`: the body named none).
pub(crate) fn answer(verdict: Verdict, status: u16, code: Option<&str>) -> ProviderAnswer {
    ProviderAnswer::new(verdict, Some(status)).with_code(code)
}

/// An answer to a request that was never sent (refused before it left): no status.
pub(crate) fn refused_before_send(code: &str) -> ProviderAnswer {
    ProviderAnswer::new(Verdict::Rejected, None).with_code(Some(code))
}

/// The `Retry-After` header as text (bounded); `None` when absent, not UTF-8 or too long.
pub(crate) fn retry_after(headers: &reqwest::header::HeaderMap) -> Option<String> {
    crate::transport::header_text(headers, "retry-after", 128)
}

/// Whether `retry_after` is present and parses (delta-seconds or an HTTP date).
pub(crate) fn has_valid_retry_after(retry_after: Option<&str>) -> bool {
    retry_after.is_some_and(|v| nudge_domain::RetryAfter::parse(v).is_ok())
}

/// The visible part and the data part of a reminder's content, as both push providers take them.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct PushContent {
    pub(crate) title: Option<String>,
    pub(crate) body: Option<String>,
    /// Every other key, string values as they are and other values as their JSON text (FCM's
    /// `data` holds strings only).
    pub(crate) data: serde_json::Map<String, serde_json::Value>,
}

impl PushContent {
    pub(crate) fn of(content: Option<&serde_json::Value>) -> Self {
        let mut out = Self::default();
        let Some(serde_json::Value::Object(map)) = content else {
            return out;
        };
        for (k, v) in map {
            match (k.as_str(), v) {
                ("title", serde_json::Value::String(s)) => out.title = Some(s.clone()),
                ("body", serde_json::Value::String(s)) => out.body = Some(s.clone()),
                (_, serde_json::Value::String(s)) => {
                    out.data
                        .insert(k.clone(), serde_json::Value::String(s.clone()));
                }
                (_, other) => {
                    out.data
                        .insert(k.clone(), serde_json::Value::String(other.to_string()));
                }
            }
        }
        out
    }
}

/// A URL key's value, checked like the generic adapter's `base_url`: http(s), a host, no
/// credentials, query or fragment. The message never repeats the URL.
pub(crate) fn parse_base_url(raw: &str) -> Result<url::Url, String> {
    let url = url::Url::parse(raw).map_err(|e| format!("not a URL ({e})"))?;
    if !matches!(url.scheme(), "http" | "https") {
        return Err(format!(
            "expected an http:// or https:// URL, found scheme `{}`",
            url.scheme()
        ));
    }
    if url.host().is_none() {
        return Err("expected a host".to_owned());
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err("must not contain credentials".to_owned());
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err("must not have a query or fragment".to_owned());
    }
    Ok(url)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn title_and_body_are_the_notification_and_every_other_key_is_string_data() {
        let c = serde_json::json!({"title": "Appointment", "body": "Tomorrow 9:00", "template": "appt", "slot": 3, "title2": null});
        let p = PushContent::of(Some(&c));
        assert_eq!(p.title.as_deref(), Some("Appointment"));
        assert_eq!(p.body.as_deref(), Some("Tomorrow 9:00"));
        assert_eq!(p.data.len(), 3);
        assert_eq!(p.data["template"], "appt");
        assert_eq!(p.data["slot"], "3");
        assert_eq!(p.data["title2"], "null");
        assert_eq!(PushContent::of(None), PushContent::default());
    }

    #[test]
    fn a_url_key_is_http_with_a_host_and_without_credentials_query_or_fragment() {
        for good in [
            "http://127.0.0.1:9/token",
            "https://oauth2.googleapis.com/token",
        ] {
            assert!(parse_base_url(good).is_ok(), "{good}");
        }
        for bad in [
            "ftp://h/",
            "http://u:p@h/",
            "http://h/?q",
            "http://h/#f",
            "nope",
        ] {
            assert!(parse_base_url(bad).is_err(), "{bad}");
        }
    }
}
