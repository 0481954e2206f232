//! The SQS client of the pipeline examples, from the environment: `SQS_URL` is the endpoint
//! (a local SQS such as moto, `http://127.0.0.1:5000`), the region `AWS_REGION` (or
//! `AWS_DEFAULT_REGION`, default `us-east-1`), static credentials from `AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY` and optionally `AWS_SESSION_TOKEN`. A local endpoint checks no
//! signature, so on a loopback host the credentials default to `test` / `test`; anywhere else
//! they must be set. The examples build plain HTTP only (no TLS stack): use the SDK's own
//! configuration chain (`aws-config`) for SQS on AWS.

use tower_idempotency::broker::sqs::aws_sdk_sqs::{
    config::{BehaviorVersion, Credentials, Region},
    Client, Config,
};

use super::var;

/// The client for the endpoint `url`, or what to set.
pub fn client(url: &str) -> Result<Client, String> {
    let Some(rest) = url.strip_prefix("http://") else {
        return Err(format!(
            "SQS_URL={url:?} must be an http:// endpoint such as http://127.0.0.1:5000 (these examples build no TLS stack; for SQS on AWS configure the client with aws-config)"
        ));
    };
    let host = rest.split(['/', ':']).next().unwrap_or_default();
    let local = matches!(host, "127.0.0.1" | "localhost") || rest.starts_with("[::1]");
    let credentials = match (var("AWS_ACCESS_KEY_ID"), var("AWS_SECRET_ACCESS_KEY")) {
        (Some(id), Some(secret)) => Credentials::new(
            id,
            secret,
            var("AWS_SESSION_TOKEN"),
            None,
            "environment",
        ),
        (None, None) if local => Credentials::new("test", "test", None, None, "local default"),
        (None, None) => {
            return Err(format!(
                "SQS_URL={url:?} is not a local endpoint: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
            ))
        }
        _ => {
            return Err("set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or neither (a local SQS endpoint only)".to_owned())
        }
    };
    let region = var("AWS_REGION")
        .or_else(|| var("AWS_DEFAULT_REGION"))
        .unwrap_or_else(|| "us-east-1".to_owned());
    let config = Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new(region))
        .credentials_provider(credentials)
        .endpoint_url(url)
        .http_client(aws_smithy_http_client::Builder::new().build_http())
        .build();
    Ok(Client::from_conf(config))
}
