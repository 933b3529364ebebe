//! The operator's side of the instance manager's HTTP API (`castellan instance`):
//! status reads and the reload call, over plain HTTP/1.1 to the pod's address. Small
//! on purpose: one request per connection, JSON bodies, a deadline on everything.

use std::time::Duration;

use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tracing::Instrument;

#[derive(Debug, thiserror::Error)]
pub enum InstanceApiError {
    #[error("calling {method} {path} on {address}: {source}")]
    Io {
        method: &'static str,
        path: String,
        address: String,
        source: std::io::Error,
    },
    #[error("calling {method} {path} on {address}: no answer within {timeout:?}")]
    Timeout {
        method: &'static str,
        path: String,
        address: String,
        timeout: Duration,
    },
    #[error("calling {method} {path} on {address}: status {status}: {body}")]
    Status {
        method: &'static str,
        path: String,
        address: String,
        status: u16,
        body: String,
    },
    #[error("calling {method} {path} on {address}: the answer is not JSON: {body}")]
    Body {
        method: &'static str,
        path: String,
        address: String,
        body: String,
    },
}

const TIMEOUT: Duration = Duration::from_secs(5);

async fn exchange(address: &str, request: String) -> std::io::Result<String> {
    let mut stream = TcpStream::connect(address).await?;
    stream.write_all(request.as_bytes()).await?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response).await?;
    Ok(String::from_utf8_lossy(&response).into_owned())
}

/// Sends one request and returns the JSON body of a 2xx answer.
pub async fn call(
    method: &'static str,
    address: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<Value, InstanceApiError> {
    call_within(method, address, path, body, TIMEOUT).await
}

/// [`call`] with another deadline, for slow operations such as a restart.
pub async fn call_within(
    method: &'static str,
    address: &str,
    path: &str,
    body: Option<&Value>,
    timeout: Duration,
) -> Result<Value, InstanceApiError> {
    let span = tracing::info_span!("instance api call", %method, %path, %address);
    let payload = body.map(Value::to_string).unwrap_or_default();
    // The trace context goes along, so the instance manager's span joins this trace.
    let trace_headers: String = span
        .in_scope(crate::telemetry::inject)
        .iter()
        .map(|(name, value)| format!("{name}: {value}\r\n"))
        .collect();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\nContent-Type: application/json\r\n{trace_headers}Content-Length: {}\r\n\r\n{payload}",
        payload.len()
    );
    let exchanged = tokio::time::timeout(timeout, exchange(address, request)).instrument(span);
    let response = match exchanged.await {
        Ok(Ok(response)) => response,
        Ok(Err(source)) => {
            return Err(InstanceApiError::Io {
                method,
                path: path.to_owned(),
                address: address.to_owned(),
                source,
            });
        }
        Err(_) => {
            return Err(InstanceApiError::Timeout {
                method,
                path: path.to_owned(),
                address: address.to_owned(),
                timeout,
            });
        }
    };
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or((&response, ""));
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    // axum answers small bodies with Content-Length (no chunking), so the body is as sent.
    if !(200..300).contains(&status) {
        return Err(InstanceApiError::Status {
            method,
            path: path.to_owned(),
            address: address.to_owned(),
            status,
            body: body.to_owned(),
        });
    }
    serde_json::from_str(body).map_err(|_| InstanceApiError::Body {
        method,
        path: path.to_owned(),
        address: address.to_owned(),
        body: body.to_owned(),
    })
}
