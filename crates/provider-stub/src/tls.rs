//! TLS with HTTP/2 for the shapes that need it (APNs): a certificate authority and a server
//! certificate for `localhost` and `127.0.0.1`, made at start-up, the authority written to a file
//! a client can be told to trust.

use std::future::Future;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context as _;
use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::service::TowerToHyperService;
use nudge_telemetry::error_chain;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair, KeyUsagePurpose,
};
use tokio::net::TcpListener;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::ServerConfig;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};

/// Makes a fresh authority and server certificate, writes the authority (PEM) to `ca_out`, and
/// returns a server configuration offering only HTTP/2 (`h2`), as APNs does.
pub fn generate(ca_out: &Path) -> anyhow::Result<Arc<ServerConfig>> {
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "provider-stub test authority");
    ca_params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca = CertifiedIssuer::self_signed(ca_params, KeyPair::generate()?)?;
    let server_key = KeyPair::generate()?;
    let mut server_params =
        CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])?;
    server_params
        .distinguished_name
        .push(DnType::CommonName, "provider-stub");
    let server_cert = server_params.signed_by(&server_key, &ca)?;
    std::fs::write(ca_out, ca.pem()).with_context(|| {
        format!(
            "failed to write the certificate authority to {}",
            ca_out.display()
        )
    })?;

    let chain = vec![
        CertificateDer::from(server_cert.der().to_vec()),
        CertificateDer::from(ca.der().to_vec()),
    ];
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(server_key.serialize_der()));
    let provider = Arc::new(tokio_rustls::rustls::crypto::aws_lc_rs::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .context("failed to choose TLS versions")?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .context("failed to build the TLS configuration")?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

/// Serves `router` over TLS and HTTP/2 on `listener` until `shutdown` completes; open
/// connections are then closed.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    tls: Arc<ServerConfig>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let acceptor = TlsAcceptor::from(tls);
    let mut connections = JoinSet::new();
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => {
                let (tcp, _) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(error.cause_chain = %error_chain(&e), "accept failed");
                        continue;
                    }
                };
                let acceptor = acceptor.clone();
                let service = TowerToHyperService::new(router.clone());
                connections.spawn(async move {
                    let tls = match acceptor.accept(tcp).await {
                        Ok(t) => t,
                        Err(e) => {
                            tracing::debug!(error.cause_chain = %error_chain(&e), "TLS handshake failed");
                            return;
                        }
                    };
                    if let Err(e) = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(tls), service)
                        .await
                    {
                        tracing::debug!(error.cause_chain = %error_chain(&e), "HTTP/2 connection ended with an error");
                    }
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    connections.shutdown().await;
    Ok(())
}
