//! Fixtures for nudge's tests: [`FaultProxy`], a TCP proxy between a process and a service
//! (RabbitMQ, PostgreSQL) that can stall, delay and cut the connections it carries.
//!
//! Owns: faults injected on the wire, so integration and end-to-end tests can show that a process
//! recovers from a service it cannot reach, without stopping a service other tests share.
//!
//! Must never: be a dependency of a shipped binary, or listen on anything but loopback.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// How the proxy treats the bytes it forwards.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Mode {
    /// Bytes are read and held, not written (the service as seen during a memory alarm or a
    /// network partition: no error, no answer), until the pause ends or the link is cut.
    paused: bool,
    /// Each chunk waits this long before it is written, in each direction.
    latency: Duration,
    /// New connections are refused (accepted and closed at once), as by a service that is down.
    refusing: bool,
}

/// A TCP proxy on `127.0.0.1:<port>` to one upstream address. Dropping it cuts every link and
/// stops listening.
#[derive(Debug)]
pub struct FaultProxy {
    port: u16,
    mode: watch::Sender<Mode>,
    links: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
    refused: Arc<std::sync::atomic::AtomicUsize>,
}

impl FaultProxy {
    /// Listens on a free loopback port and forwards each connection to `upstream`
    /// (`host:port`). A connection the upstream refuses is closed.
    pub async fn start(upstream: impl Into<String>) -> std::io::Result<FaultProxy> {
        let upstream = upstream.into();
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let port = listener.local_addr()?.port();
        let (mode, _) = watch::channel(Mode::default());
        let links: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::new(Mutex::new(Vec::new()));
        let refused = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let accept = {
            let mode = mode.clone();
            let links = Arc::clone(&links);
            let refused = Arc::clone(&refused);
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    if mode.borrow().refusing {
                        drop(client);
                        refused.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        continue;
                    }
                    let Ok(server) = TcpStream::connect(upstream.as_str()).await else {
                        continue;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (client_read, client_write) = client.into_split();
                    let (server_read, server_write) = server.into_split();
                    let mut links = links.lock().unwrap_or_else(PoisonError::into_inner);
                    links.retain(|link| !link.is_finished());
                    links.push(tokio::spawn(forward(
                        client_read,
                        server_write,
                        mode.subscribe(),
                    )));
                    links.push(tokio::spawn(forward(
                        server_read,
                        client_write,
                        mode.subscribe(),
                    )));
                }
            })
        };
        Ok(FaultProxy {
            port,
            mode,
            links,
            accept,
            refused,
        })
    }

    /// The loopback port clients connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `127.0.0.1:<port>`.
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Holds (`true`) or releases (`false`) the bytes of every link; see `Mode`.
    pub fn pause(&self, paused: bool) {
        self.mode.send_modify(|m| m.paused = paused);
    }

    /// Delays every chunk forwarded from now on by `latency`, each direction.
    pub fn set_latency(&self, latency: Duration) {
        self.mode.send_modify(|m| m.latency = latency);
    }

    /// Refuses (`true`) or accepts (`false`) new connections; links already up are untouched.
    pub fn refuse(&self, refusing: bool) {
        self.mode.send_modify(|m| m.refusing = refusing);
    }

    /// How many connections were refused while [`refuse`](Self::refuse) was on.
    pub fn refused(&self) -> usize {
        self.refused.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many connections the proxy carries now.
    pub fn connections(&self) -> usize {
        let links = self.links.lock().unwrap_or_else(PoisonError::into_inner);
        links.iter().filter(|link| !link.is_finished()).count() / 2
    }

    /// Drops every forwarded connection, and the bytes held back with it. Returns how many
    /// connections were cut.
    pub fn cut(&self) -> usize {
        let mut links = self.links.lock().unwrap_or_else(PoisonError::into_inner);
        let live = links.iter().filter(|link| !link.is_finished()).count();
        for link in links.drain(..) {
            link.abort();
        }
        live / 2
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.cut();
        self.accept.abort();
    }
}

async fn forward(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut mode: watch::Receiver<Mode>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let Ok(n) = from.read(&mut buf).await else {
            return;
        };
        if n == 0 {
            let _ = to.shutdown().await;
            return;
        }
        // Bytes read while paused are held until the pause ends (or dropped by a cut).
        let Ok(current) = mode.wait_for(|m| !m.paused).await.map(|m| *m) else {
            return;
        };
        if !current.latency.is_zero() {
            tokio::time::sleep(current.latency).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use super::*;

    async fn echo_server() -> (String, JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let task = tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = socket.read(&mut buf).await {
                        if n == 0 || socket.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (addr, task)
    }

    async fn round_trip(stream: &mut TcpStream) -> std::io::Result<Vec<u8>> {
        stream.write_all(b"ping").await?;
        let mut buf = [0u8; 4];
        stream.read_exact(&mut buf).await?;
        Ok(buf.to_vec())
    }

    #[tokio::test]
    async fn bytes_pass_through_and_a_cut_closes_the_link() {
        let (addr, server) = echo_server().await;
        let proxy = FaultProxy::start(addr).await.unwrap();
        let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(round_trip(&mut client).await.unwrap(), b"ping");
        assert_eq!(proxy.cut(), 1);
        let mut buf = [0u8; 4];
        let after_cut = tokio::time::timeout(Duration::from_secs(5), async {
            let _ = client.write_all(b"ping").await;
            client.read(&mut buf).await
        })
        .await
        .expect("a cut link ends within 5 s");
        assert!(matches!(after_cut, Ok(0) | Err(_)), "{after_cut:?}");
        server.abort();
    }

    #[tokio::test]
    async fn a_refusing_proxy_closes_new_connections_and_takes_them_again_when_told() {
        let (addr, server) = echo_server().await;
        let proxy = FaultProxy::start(addr).await.unwrap();
        proxy.refuse(true);
        let mut refused = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(round_trip(&mut refused).await.is_err());
        proxy.refuse(false);
        let mut accepted = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(round_trip(&mut accepted).await.unwrap(), b"ping");
        server.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn latency_delays_each_direction_and_a_pause_holds_bytes_until_released() {
        let (addr, server) = echo_server().await;
        let proxy = FaultProxy::start(addr).await.unwrap();
        let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
        proxy.set_latency(Duration::from_millis(200));
        let started = tokio::time::Instant::now();
        assert_eq!(round_trip(&mut client).await.unwrap(), b"ping");
        assert!(started.elapsed() >= Duration::from_millis(400));

        proxy.set_latency(Duration::ZERO);
        proxy.pause(true);
        let held = tokio::time::timeout(Duration::from_secs(2), round_trip(&mut client)).await;
        assert!(held.is_err(), "nothing passes while paused");
        proxy.pause(false);
        let mut buf = [0u8; 4];
        client.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"ping");
        server.abort();
    }
}
