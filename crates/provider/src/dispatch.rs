//! The one place a provider account's `kind` becomes an adapter.

use std::sync::Arc;

use crate::{DynProvider, HttpProvider, HttpProviderConfig, ProviderError, ProviderKind};

/// Validates `cfg` (errors name keys relative to the provider section) and builds the adapter
/// its `kind` names, behind [`DynProvider`] so a worker holds accounts of several kinds.
pub fn build(cfg: &HttpProviderConfig) -> Result<Arc<dyn DynProvider>, ProviderError> {
    cfg.validate("")?;
    Ok(match cfg.kind {
        ProviderKind::Generic => Arc::new(HttpProvider::new(cfg)?),
        ProviderKind::Twilio => Arc::new(crate::twilio::TwilioProvider::new(cfg)?),
        ProviderKind::Sendgrid => Arc::new(crate::sendgrid::SendgridProvider::new(cfg)?),
        ProviderKind::Fcm => Arc::new(crate::fcm::FcmProvider::new(cfg)?),
        ProviderKind::Apns => Arc::new(crate::apns::ApnsProvider::new(cfg)?),
    })
}
