//! The one place a provider account's `kind` becomes an adapter.

use std::sync::Arc;

use crate::{DynProvider, HttpProvider, HttpProviderConfig, ProviderError, ProviderKind};

/// Validates `cfg` (errors name keys relative to the provider section) and builds the adapter
/// its `kind` names, behind [`DynProvider`] so a worker holds accounts of several kinds.
pub fn build(cfg: &HttpProviderConfig) -> Result<Arc<dyn DynProvider>, ProviderError> {
    cfg.validate("")?;
    match cfg.kind {
        ProviderKind::Generic => Ok(Arc::new(HttpProvider::new(cfg)?)),
        ProviderKind::Twilio => Ok(Arc::new(crate::twilio::TwilioProvider::new(cfg)?)),
        ProviderKind::Sendgrid => Ok(Arc::new(crate::sendgrid::SendgridProvider::new(cfg)?)),
        // The push kinds' adapters plug in here.
        ProviderKind::Fcm | ProviderKind::Apns => Err(ProviderError::Unsupported {
            account: cfg
                .parsed_account()
                .map_err(|e| nudge_config::ConfigError::invalid("account", e.to_string()))?,
            kind: cfg.kind,
        }),
    }
}
