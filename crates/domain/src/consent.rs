//! Consent: whether a destination may be reached, where a change of it came from, and what a
//! patient's reply to a message means.
//!
//! An opt-out belongs to the destination (the number, the address, the token), not to the
//! subscriber it was posted for: the ledger keys it by the destination's keyed digest, so a
//! repost, a new subscriber reference or an erasure never clears it. Only an opt-in clears it.

use std::fmt;

/// Whether a destination may be reached on its channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ConsentState {
    OptedIn,
    OptedOut,
}

impl ConsentState {
    pub const fn as_str(self) -> &'static str {
        match self {
            ConsentState::OptedIn => "opted_in",
            ConsentState::OptedOut => "opted_out",
        }
    }

    /// The state as the ledger stores it.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "opted_in" => Some(ConsentState::OptedIn),
            "opted_out" => Some(ConsentState::OptedOut),
            _ => None,
        }
    }
}

impl fmt::Display for ConsentState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a change of consent came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ConsentSource {
    /// The clinic, through the preferences API.
    Api,
    /// The patient's reply to a message (STOP, START).
    InboundKeyword,
    /// A provider said the recipient opted out (an error such as Twilio's 21610, or a
    /// receipt's unsubscribe).
    ProviderStop,
    /// A provider said the address bounced for good.
    ProviderBounce,
    /// An operator, with `nudgectl`.
    Operator,
    /// A bulk import.
    Import,
}

impl ConsentSource {
    pub const ALL: [ConsentSource; 6] = [
        ConsentSource::Api,
        ConsentSource::InboundKeyword,
        ConsentSource::ProviderStop,
        ConsentSource::ProviderBounce,
        ConsentSource::Operator,
        ConsentSource::Import,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            ConsentSource::Api => "api",
            ConsentSource::InboundKeyword => "inbound_keyword",
            ConsentSource::ProviderStop => "provider_stop",
            ConsentSource::ProviderBounce => "provider_bounce",
            ConsentSource::Operator => "operator",
            ConsentSource::Import => "import",
        }
    }

    /// The source as the ledger stores it.
    pub fn parse(text: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_str() == text)
    }
}

impl fmt::Display for ConsentSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a patient's reply to an SMS asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Keyword {
    /// STOP, STOPALL, UNSUBSCRIBE, CANCEL, END, QUIT: no more messages.
    Stop,
    /// START, YES, UNSTOP: messages again.
    Start,
    /// HELP, INFO: changes nothing.
    Help,
}

impl Keyword {
    /// The keyword a message body is, if it is one: the whole body, in any case, with
    /// surrounding white space ignored (the carriers' rule: "please STOP" is not a STOP).
    pub fn of_body(body: &str) -> Option<Self> {
        let word = body.trim().to_ascii_uppercase();
        match word.as_str() {
            "STOP" | "STOPALL" | "UNSUBSCRIBE" | "CANCEL" | "END" | "QUIT" => Some(Keyword::Stop),
            "START" | "YES" | "UNSTOP" => Some(Keyword::Start),
            "HELP" | "INFO" => Some(Keyword::Help),
            _ => None,
        }
    }

    /// The consent it sets, if any.
    pub const fn consent(self) -> Option<ConsentState> {
        match self {
            Keyword::Stop => Some(ConsentState::OptedOut),
            Keyword::Start => Some(ConsentState::OptedIn),
            Keyword::Help => None,
        }
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            Keyword::Stop => "stop",
            Keyword::Start => "start",
            Keyword::Help => "help",
        }
    }
}

/// The keyword as received, for the consent history: trimmed and at most 64 characters (a
/// keyword is a single word; anything longer is cut, never kept whole).
pub fn keyword_as_received(body: &str) -> String {
    body.trim().chars().take(64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keywords_are_whole_bodies_in_any_case() {
        for (body, keyword) in [
            ("STOP", Some(Keyword::Stop)),
            ("  stop \n", Some(Keyword::Stop)),
            ("StopAll", Some(Keyword::Stop)),
            ("unsubscribe", Some(Keyword::Stop)),
            ("Cancel", Some(Keyword::Stop)),
            ("end", Some(Keyword::Stop)),
            ("QUIT", Some(Keyword::Stop)),
            ("start", Some(Keyword::Start)),
            (" Yes", Some(Keyword::Start)),
            ("UNSTOP", Some(Keyword::Start)),
            ("help", Some(Keyword::Help)),
            ("please stop", None),
            ("STOP!", None),
            ("", None),
            ("stopp", None),
        ] {
            assert_eq!(Keyword::of_body(body), keyword, "{body:?}");
        }
        assert_eq!(Keyword::Stop.consent(), Some(ConsentState::OptedOut));
        assert_eq!(Keyword::Start.consent(), Some(ConsentState::OptedIn));
        assert_eq!(Keyword::Help.consent(), None);
    }

    #[test]
    fn a_keyword_as_received_is_trimmed_and_bounded() {
        assert_eq!(keyword_as_received("  Stop \r\n"), "Stop");
        assert_eq!(keyword_as_received(&"x".repeat(200)).chars().count(), 64);
    }

    #[test]
    fn states_and_sources_serialise_as_the_ledger_spells_them() {
        for state in [ConsentState::OptedIn, ConsentState::OptedOut] {
            assert_eq!(
                serde_json::to_value(state).unwrap(),
                serde_json::json!(state.as_str())
            );
        }
        for source in ConsentSource::ALL {
            assert_eq!(
                serde_json::to_value(source).unwrap(),
                serde_json::json!(source.as_str())
            );
        }
    }

    #[test]
    fn states_and_sources_read_back() {
        for state in [ConsentState::OptedIn, ConsentState::OptedOut] {
            assert_eq!(ConsentState::parse(state.as_str()), Some(state));
        }
        for source in ConsentSource::ALL {
            assert_eq!(ConsentSource::parse(source.as_str()), Some(source));
        }
        assert_eq!(ConsentSource::parse("nope"), None);
    }
}

/// What a reminder is about, as its tenant names it (`appointment`, `billing`): a patient may
/// switch a category off per channel, unless the tenant made it `required`. Every tenant has
/// [`Category::GENERAL`], never required, which a reminder without a category belongs to.
/// 1 to 64 characters: lower-case ASCII letters, digits, `_` and `-`, starting with a letter
/// or a digit.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(transparent)]
pub struct Category(String);

/// Why a category name is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "a category is 1 to 64 characters: lower-case letters, digits, '_' and '-', starting with a letter or a digit"
)]
pub struct CategoryError;

impl Category {
    /// The category every tenant has, and a reminder without one belongs to.
    pub const GENERAL: &'static str = "general";

    pub fn parse(name: &str) -> Result<Self, CategoryError> {
        let mut bytes = name.bytes();
        let first_ok = bytes
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit());
        let rest_ok =
            bytes.all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
        if !first_ok || !rest_ok || name.len() > 64 {
            return Err(CategoryError);
        }
        Ok(Self(name.to_owned()))
    }

    pub fn general() -> Self {
        Self(Self::GENERAL.to_owned())
    }

    pub fn is_general(&self) -> bool {
        self.0 == Self::GENERAL
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for Category {
    fn default() -> Self {
        Self::general()
    }
}

impl fmt::Display for Category {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod category_tests {
    use super::*;

    #[test]
    fn a_category_name_is_checked() {
        for good in ["general", "appointment", "billing-2", "a", "9lives", "x_y"] {
            assert_eq!(
                Category::parse(good).map(|c| c.to_string()),
                Ok(good.to_owned())
            );
        }
        let long = "a".repeat(65);
        for bad in ["", "Appointment", "-x", "_x", "a b", "café", long.as_str()] {
            assert_eq!(Category::parse(bad), Err(CategoryError), "{bad:?}");
        }
        assert_eq!(
            Category::parse(&"a".repeat(64)).map(|c| c.as_str().len()),
            Ok(64)
        );
        assert!(Category::default().is_general());
    }
}
