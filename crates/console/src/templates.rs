//! The pages' templates (`templates/*.html`, compiled in), rendered with minijinja. Every
//! template's name ends in `.html`, so every value is HTML-escaped; undefined values are
//! errors (strict), never an empty string that hides a mistake.

use minijinja::{Environment, UndefinedBehavior, Value};

const TEMPLATES: &[(&str, &str)] = &[
    ("base.html", include_str!("../templates/base.html")),
    ("login.html", include_str!("../templates/login.html")),
    ("error.html", include_str!("../templates/error.html")),
    ("overview.html", include_str!("../templates/overview.html")),
    ("tenants.html", include_str!("../templates/tenants.html")),
    (
        "dead_letters.html",
        include_str!("../templates/dead_letters.html"),
    ),
    ("redrives.html", include_str!("../templates/redrives.html")),
    (
        "redrive_plan.html",
        include_str!("../templates/redrive_plan.html"),
    ),
    ("trace.html", include_str!("../templates/trace.html")),
    ("audit.html", include_str!("../templates/audit.html")),
];

/// The console's stylesheet, served at `/static/console.css`.
pub const STYLESHEET: &str = include_str!("../templates/console.css");

pub fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_undefined_behavior(UndefinedBehavior::Strict);
    for (name, source) in TEMPLATES {
        if let Err(e) = env.add_template(name, source) {
            // A template that does not parse is a build defect; the tests render every page.
            tracing::error!(
                error.cause_chain = %nudge_telemetry::error_chain(&e),
                template = name,
                "a console template does not parse"
            );
        }
    }
    env.add_filter("age", age);
    env.add_filter("when", when);
    env
}

/// Seconds as a short age: `42s`, `3m 05s`, `2h 01m`, `3d 4h`.
fn age(seconds: Value) -> String {
    let Ok(s) = i64::try_from(seconds) else {
        return "–".to_owned();
    };
    let s = s.max(0);
    match s {
        0..60 => format!("{s}s"),
        60..3_600 => format!("{}m {:02}s", s / 60, s % 60),
        3_600..86_400 => format!("{}h {:02}m", s / 3_600, (s % 3_600) / 60),
        _ => format!("{}d {}h", s / 86_400, (s % 86_400) / 3_600),
    }
}

/// An RFC 3339 time as `2026-12-03 16:21:40Z` (seconds, UTC).
fn when(value: Value) -> String {
    let Some(text) = value.as_str() else {
        return "–".to_owned();
    };
    match chrono::DateTime::parse_from_rfc3339(text) {
        Ok(t) => t
            .with_timezone(&chrono::Utc)
            .format("%Y-%m-%d %H:%M:%SZ")
            .to_string(),
        Err(_) => text.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_template_parses() {
        let env = environment();
        for (name, _) in TEMPLATES {
            assert!(env.get_template(name).is_ok(), "{name} does not parse");
        }
    }

    #[test]
    fn ages_read_at_a_glance() {
        assert_eq!(age(Value::from(42)), "42s");
        assert_eq!(age(Value::from(185)), "3m 05s");
        assert_eq!(age(Value::from(7_260)), "2h 01m");
        assert_eq!(age(Value::from(273_600)), "3d 4h");
        assert_eq!(age(Value::from(())), "–");
    }
}
