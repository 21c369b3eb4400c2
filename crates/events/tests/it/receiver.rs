//! A tenant's endpoint on loopback: records every request it is sent and answers as its test
//! scripts. It stops when its test ends (the runtime's tasks end with it).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

/// One request as received.
#[derive(Debug, Clone)]
pub struct Received {
    pub at: Instant,
    pub headers: HeaderMap,
    pub body: Bytes,
    /// What it was answered.
    pub status: u16,
}

impl Received {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap()
    }

    pub fn id(&self) -> String {
        self.headers["webhook-id"].to_str().unwrap().to_owned()
    }

    /// The positions of the events in the batch.
    pub fn positions(&self) -> Vec<i64> {
        self.json()["data"]["events"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| e["position"].as_i64().unwrap())
            .collect()
    }
}

/// How to answer the request numbered `n` (0 for the first).
pub enum Answer {
    Status(u16),
    /// A status with `Retry-After: <seconds>`.
    RetryAfter(u16, u64),
    /// A redirect to the location.
    Redirect(String),
    /// A status after a delay.
    Slow(u16, Duration),
    /// Never answer (until the test ends).
    Hang,
}

type Script = Box<dyn Fn(usize) -> Answer + Send + Sync>;

#[derive(Clone)]
struct Shared {
    script: Arc<Script>,
    received: Arc<Mutex<Vec<Received>>>,
}

/// A running receiver.
#[derive(Clone)]
pub struct Receiver {
    pub addr: SocketAddr,
    received: Arc<Mutex<Vec<Received>>>,
}

impl Receiver {
    /// Starts a receiver on 127.0.0.1 (`port` 0: any).
    pub async fn start(
        port: u16,
        script: impl Fn(usize) -> Answer + Send + Sync + 'static,
    ) -> Self {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let received = Arc::new(Mutex::new(Vec::new()));
        let shared = Shared {
            script: Arc::new(Box::new(script)),
            received: received.clone(),
        };
        let app = axum::Router::new().fallback(answer).with_state(shared);
        tokio::spawn(async move {
            axum::serve(listener, app).await.ok();
        });
        Self { addr, received }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn received(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }
}

async fn answer(State(shared): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    let n;
    let decided = {
        let mut received = shared.received.lock().unwrap();
        n = received.len();
        let decided = (shared.script)(n);
        let status = match &decided {
            Answer::Status(s) | Answer::RetryAfter(s, _) | Answer::Slow(s, _) => *s,
            Answer::Redirect(_) => 307,
            Answer::Hang => 0,
        };
        received.push(Received {
            at: Instant::now(),
            headers,
            body,
            status,
        });
        decided
    };
    match decided {
        Answer::Status(s) => StatusCode::from_u16(s).unwrap().into_response(),
        Answer::Slow(s, delay) => {
            tokio::time::sleep(delay).await;
            StatusCode::from_u16(s).unwrap().into_response()
        }
        Answer::RetryAfter(s, after) => {
            let mut response = StatusCode::from_u16(s).unwrap().into_response();
            response.headers_mut().insert(
                "retry-after",
                HeaderValue::from_str(&after.to_string()).unwrap(),
            );
            response
        }
        Answer::Redirect(to) => {
            let mut response = StatusCode::TEMPORARY_REDIRECT.into_response();
            response
                .headers_mut()
                .insert("location", HeaderValue::from_str(&to).unwrap());
            response
        }
        Answer::Hang => {
            tokio::time::sleep(Duration::from_secs(3_600)).await;
            StatusCode::OK.into_response()
        }
    }
}

/// Waits until `done` holds, checking every 50 ms, for at most `limit`; `false` when it never did.
pub async fn wait_for(limit: Duration, mut done: impl AsyncFnMut() -> bool) -> bool {
    let until = Instant::now() + limit;
    loop {
        if done().await {
            return true;
        }
        if Instant::now() >= until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
