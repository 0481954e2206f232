//! The HTTP face of optimistic concurrency: entity-tag parsing, RFC 9110 §13.2.2
//! precondition evaluation, 428 / 412 / 304 / 400 / 404 responses, through a real axum app.
#![cfg(feature = "axum")]

use axum::{
    body::Body,
    extract::{Path, State},
    http::{Method, Request, StatusCode},
    response::{IntoResponse, Response},
    routing::get,
    Json, Router,
};
use http::{HeaderMap, HeaderValue};
use http_body_util::BodyExt;
use tower::ServiceExt;
use tower_idempotency::version::{
    ETag, ETagList, InsertOutcome, MemoryVersioned, PreconditionRejection, Preconditions,
    RequireIfMatch, Version,
};

type Docs = MemoryVersioned<u32, String>;

async fn read(
    Path(id): Path<u32>,
    State(docs): State<Docs>,
    pre: Preconditions,
    method: Method,
) -> Response {
    let current = docs.get(&id);
    let tag = current.as_ref().map(|c| ETag::from(c.version));
    if let Err(rejection) = pre.evaluate(&method, tag.as_ref()) {
        return rejection.into_response();
    }
    match (current, tag) {
        (Some(current), Some(tag)) => (tag, current.value).into_response(),
        _ => PreconditionRejection::NotFound.into_response(),
    }
}

/// PATCH: If-Match required; one conditional update, no read first.
async fn patch(
    Path(id): Path<u32>,
    State(docs): State<Docs>,
    RequireIfMatch(pre): RequireIfMatch,
    body: String,
) -> Result<impl IntoResponse, PreconditionRejection> {
    let (version, row) = docs
        .update_if_version(&id, pre.expected(), |doc| *doc = body)
        .into_http()?;
    Ok((ETag::from(version), row.unwrap_or_default()))
}

/// PUT: create (`If-None-Match: *`) or replace (`If-Match`), evaluated against the current tag.
async fn put(
    Path(id): Path<u32>,
    State(docs): State<Docs>,
    pre: Preconditions,
    body: String,
) -> Result<Response, PreconditionRejection> {
    let current = docs.get(&id).map(|c| ETag::from(c.version));
    match (pre.evaluate(&Method::PUT, current.as_ref()), current) {
        // Absent, and nothing demanded it to exist: create, decided by the insert itself.
        (Ok(()) | Err(PreconditionRejection::NotFound), None) => {
            let version = docs.insert_new(id, body).into_http()?;
            Ok((StatusCode::CREATED, ETag::from(version), ()).into_response())
        }
        (Ok(()), Some(_)) => {
            let (version, _) = docs
                .update_if_version(&id, pre.expected(), |doc| *doc = body)
                .into_http()?;
            Ok((ETag::from(version), Json(version.get())).into_response())
        }
        (Err(rejection), _) => Err(rejection),
    }
}

fn app() -> (Router, Docs) {
    let docs = Docs::new();
    assert!(matches!(
        docs.insert_new(1, "first".into()),
        InsertOutcome::Created { .. }
    ));
    let router = Router::new()
        .route("/docs/{id}", get(read).patch(patch).put(put))
        .with_state(docs.clone());
    (router, docs)
}

struct Answer {
    status: StatusCode,
    headers: HeaderMap,
    body: String,
}

impl Answer {
    fn etag(&self) -> Option<&str> {
        self.headers.get("etag").map(|v| v.to_str().unwrap())
    }

    fn problem_type(&self) -> String {
        assert_eq!(
            self.headers["content-type"], "application/problem+json",
            "{}",
            self.body
        );
        let json: serde_json::Value = serde_json::from_str(&self.body).unwrap();
        assert_eq!(json["status"], self.status.as_u16());
        assert!(json["detail"].as_str().is_some_and(|d| !d.is_empty()));
        json["type"].as_str().unwrap().to_owned()
    }
}

async fn send(
    router: &Router,
    method: &str,
    uri: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Answer {
    let mut request = Request::builder().method(method).uri(uri);
    for (name, value) in headers {
        request = request.header(*name, HeaderValue::from_bytes(value.as_bytes()).unwrap());
    }
    let response = router
        .clone()
        .oneshot(request.body(Body::from(body.to_owned())).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    Answer {
        status,
        headers,
        body: String::from_utf8(bytes.to_vec()).unwrap(),
    }
}

#[tokio::test]
async fn get_sends_a_strong_etag_and_404_is_problem_json() {
    let (router, _) = app();
    let ok = send(&router, "GET", "/docs/1", &[], "").await;
    assert_eq!(
        (ok.status, ok.etag(), ok.body.as_str()),
        (StatusCode::OK, Some("\"1\""), "first")
    );
    let missing = send(&router, "GET", "/docs/9", &[], "").await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    assert_eq!(missing.problem_type(), "urn:tower-idempotency:not-found");
}

#[tokio::test]
async fn patch_without_if_match_is_428() {
    let (router, docs) = app();
    let answer = send(&router, "PATCH", "/docs/1", &[], "new").await;
    assert_eq!(answer.status, StatusCode::PRECONDITION_REQUIRED);
    assert_eq!(
        answer.problem_type(),
        "urn:tower-idempotency:precondition-required"
    );
    assert!(answer.body.contains("If-Match"), "{}", answer.body);
    // If-None-Match alone does not satisfy a route that requires If-Match.
    let answer = send(
        &router,
        "PATCH",
        "/docs/1",
        &[("if-none-match", "\"5\"")],
        "new",
    )
    .await;
    assert_eq!(answer.status, StatusCode::PRECONDITION_REQUIRED);
    assert_eq!(docs.get(&1).unwrap().value, "first");
}

#[tokio::test]
async fn patch_with_current_etag_updates_and_returns_the_new_etag() {
    let (router, docs) = app();
    let answer = send(
        &router,
        "PATCH",
        "/docs/1",
        &[("if-match", "\"1\"")],
        "second",
    )
    .await;
    assert_eq!(
        (answer.status, answer.etag()),
        (StatusCode::OK, Some("\"2\""))
    );
    assert_eq!(answer.body, "second");
    assert_eq!(docs.get(&1).unwrap().version, Version::new(2));
}

#[tokio::test]
async fn stale_if_match_is_412_with_the_current_etag() {
    let (router, docs) = app();
    let _ = docs.update_if_version(&1, Version::INITIAL, |d| *d = "someone else".into());
    let answer = send(
        &router,
        "PATCH",
        "/docs/1",
        &[("if-match", "\"1\"")],
        "mine",
    )
    .await;
    assert_eq!(
        (answer.status, answer.etag()),
        (StatusCode::PRECONDITION_FAILED, Some("\"2\""))
    );
    assert_eq!(
        answer.problem_type(),
        "urn:tower-idempotency:precondition-failed"
    );
    assert_eq!(docs.get(&1).unwrap().value, "someone else");
}

#[tokio::test]
async fn weak_tags_never_match_if_match() {
    let (router, docs) = app();
    let answer = send(&router, "PATCH", "/docs/1", &[("if-match", "W/\"1\"")], "x").await;
    assert_eq!(
        (answer.status, answer.etag()),
        (StatusCode::PRECONDITION_FAILED, Some("\"1\""))
    );
    let answer = send(&router, "PUT", "/docs/1", &[("if-match", "W/\"1\"")], "x").await;
    assert_eq!(
        (answer.status, answer.etag()),
        (StatusCode::PRECONDITION_FAILED, Some("\"1\""))
    );
    assert_eq!(docs.get(&1).unwrap().version, Version::INITIAL);
}

#[tokio::test]
async fn a_list_over_several_header_lines_matches_any_member() {
    let (router, _) = app();
    let answer = send(
        &router,
        "PATCH",
        "/docs/1",
        &[
            ("if-match", "\"7\", W/\"1\""),
            ("if-match", "\"8\",,  \"1\""),
        ],
        "listed",
    )
    .await;
    assert_eq!(
        (answer.status, answer.etag()),
        (StatusCode::OK, Some("\"2\""))
    );
}

#[tokio::test]
async fn if_match_star_matches_an_existing_resource_only() {
    let (router, docs) = app();
    let answer = send(&router, "PATCH", "/docs/1", &[("if-match", "*")], "any").await;
    assert_eq!(
        (answer.status, answer.etag()),
        (StatusCode::OK, Some("\"2\""))
    );
    // PUT could create the resource, so a failed If-Match on a missing one is 412.
    let answer = send(&router, "PUT", "/docs/9", &[("if-match", "*")], "x").await;
    assert_eq!(
        (answer.status, answer.etag()),
        (StatusCode::PRECONDITION_FAILED, None)
    );
    assert_eq!(
        answer.problem_type(),
        "urn:tower-idempotency:precondition-failed"
    );
    assert!(docs.get(&9).is_none());
    // PATCH of a missing resource is 404 (RFC 9110 §13.2.1: it would fail without the
    // precondition too).
    let answer = send(&router, "PATCH", "/docs/9", &[("if-match", "\"1\"")], "x").await;
    assert_eq!(answer.status, StatusCode::NOT_FOUND);
    assert_eq!(answer.problem_type(), "urn:tower-idempotency:not-found");
}

#[tokio::test]
async fn if_none_match_star_makes_a_create_only_put() {
    let (router, docs) = app();
    let created = send(
        &router,
        "PUT",
        "/docs/2",
        &[("if-none-match", "*")],
        "new doc",
    )
    .await;
    assert_eq!(
        (created.status, created.etag()),
        (StatusCode::CREATED, Some("\"1\""))
    );
    let again = send(
        &router,
        "PUT",
        "/docs/2",
        &[("if-none-match", "*")],
        "overwrite?",
    )
    .await;
    assert_eq!(
        (again.status, again.etag()),
        (StatusCode::PRECONDITION_FAILED, Some("\"1\""))
    );
    assert_eq!(docs.get(&2).unwrap().value, "new doc");
}

#[tokio::test]
async fn if_none_match_on_get_is_304_with_weak_comparison() {
    let (router, _) = app();
    for header in ["\"1\"", "W/\"1\"", "*", "\"0\", \"1\""] {
        let answer = send(&router, "GET", "/docs/1", &[("if-none-match", header)], "").await;
        assert_eq!(
            (answer.status, answer.etag()),
            (StatusCode::NOT_MODIFIED, Some("\"1\"")),
            "{header}"
        );
        assert!(answer.body.is_empty());
    }
    let answer = send(
        &router,
        "HEAD",
        "/docs/1",
        &[("if-none-match", "\"1\"")],
        "",
    )
    .await;
    assert_eq!(answer.status, StatusCode::NOT_MODIFIED);
    let answer = send(&router, "GET", "/docs/1", &[("if-none-match", "\"0\"")], "").await;
    assert_eq!(
        (answer.status, answer.body.as_str()),
        (StatusCode::OK, "first")
    );
    // A matching If-None-Match on a write is 412, not 304.
    let answer = send(
        &router,
        "PUT",
        "/docs/1",
        &[("if-none-match", "W/\"1\"")],
        "x",
    )
    .await;
    assert_eq!(answer.status, StatusCode::PRECONDITION_FAILED);
}

#[tokio::test]
async fn malformed_preconditions_are_400_problem_json() {
    let (router, docs) = app();
    let garbage: &[&[(&str, &str)]] = &[
        &[("if-match", "1")],
        &[("if-match", "\"1")],
        &[("if-match", "\"1\" \"2\"")],
        &[("if-match", "w/\"1\"")],
        &[("if-match", "\"1\", abc")],
        &[("if-match", "")],
        &[("if-match", " , ")],
        &[("if-match", "\"a b\"")],
        &[("if-match", "*, \"1\"")],
        &[("if-match", "*"), ("if-match", "\"1\"")],
        &[("if-match", "\"1\""), ("if-none-match", "**")],
    ];
    for headers in garbage {
        let answer = send(&router, "PATCH", "/docs/1", headers, "x").await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{headers:?}");
        assert_eq!(
            answer.problem_type(),
            "urn:tower-idempotency:invalid-precondition"
        );
        let answer = send(&router, "GET", "/docs/1", headers, "").await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{headers:?}");
    }
    assert_eq!(docs.get(&1).unwrap().version, Version::INITIAL);
}

/// A list of `n` tags ending with the current one (`"1"`), so that only the cap can refuse it.
fn tags_ending_with_current(n: u64) -> Vec<String> {
    let mut tags: Vec<String> = (1..n).map(|i| format!("\"{}\"", 1000 + i)).collect();
    tags.push("\"1\"".to_owned());
    tags
}

#[tokio::test]
async fn more_entity_tags_than_the_limit_are_400_and_change_nothing() {
    let limit = ETagList::MAX_TAGS as u64;
    let (router, docs) = app();
    let at_limit = tags_ending_with_current(limit).join(", ");
    let over = tags_ending_with_current(limit + 1);
    // Over the limit on one line, or spread over several lines of the header.
    let one_line = over.join(", ");
    let (first, second) = over.split_at(over.len() / 2);
    let (first, second) = (first.join(", "), second.join(", "));
    for headers in [
        vec![("if-match", one_line.as_str())],
        vec![("if-match", first.as_str()), ("if-match", second.as_str())],
    ] {
        let answer = send(&router, "PATCH", "/docs/1", &headers, "x").await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST);
        assert_eq!(
            answer.problem_type(),
            "urn:tower-idempotency:invalid-precondition"
        );
        assert!(answer.body.contains(&limit.to_string()), "{}", answer.body);
        let none_match: Vec<_> = headers.iter().map(|(_, v)| ("if-none-match", *v)).collect();
        let answer = send(&router, "GET", "/docs/1", &none_match, "").await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    }
    assert_eq!(docs.get(&1).unwrap().version, Version::INITIAL);
    // Exactly the limit is still a valid list, and the current tag in it matches.
    let answer = send(
        &router,
        "PATCH",
        "/docs/1",
        &[("if-match", at_limit.as_str())],
        "y",
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.body);
    assert_eq!(docs.get(&1).unwrap().version, Version::new(2));
}

#[test]
fn evaluation_order_follows_rfc_9110() {
    let tag = |v| ETag::from(Version::new(v));
    let pre = |if_match: Option<&str>, if_none_match: Option<&str>| {
        let mut headers = HeaderMap::new();
        if let Some(v) = if_match {
            headers.insert("if-match", HeaderValue::from_str(v).unwrap());
        }
        if let Some(v) = if_none_match {
            headers.insert("if-none-match", HeaderValue::from_str(v).unwrap());
        }
        Preconditions::from_headers(&headers).unwrap()
    };
    // If-Match is decided first: failing it is 412 even on GET with a matching If-None-Match.
    let both = pre(Some("\"2\""), Some("\"1\""));
    assert!(matches!(
        both.evaluate(&Method::GET, Some(&tag(1))),
        Err(PreconditionRejection::Failed { .. })
    ));
    // Passing If-Match, then If-None-Match decides: 304 on GET, 412 on POST.
    let both = pre(Some("\"1\""), Some("\"1\""));
    assert!(matches!(
        both.evaluate(&Method::GET, Some(&tag(1))),
        Err(PreconditionRejection::NotModified { .. })
    ));
    assert!(matches!(
        both.evaluate(&Method::POST, Some(&tag(1))),
        Err(PreconditionRejection::Failed { .. })
    ));
    // Missing resource: If-Match fails (412), If-None-Match passes, nothing at all is 404.
    assert_eq!(
        pre(Some("*"), None).evaluate(&Method::PUT, None),
        Err(PreconditionRejection::Failed { current: None })
    );
    assert_eq!(pre(None, Some("*")).evaluate(&Method::PUT, None), Ok(()));
    assert_eq!(
        pre(None, None).evaluate(&Method::GET, None),
        Err(PreconditionRejection::NotFound)
    );
    assert_eq!(
        pre(None, None).evaluate(&Method::GET, Some(&tag(1))),
        Ok(())
    );
}

#[test]
fn entity_tag_syntax() {
    assert_eq!(ETag::parse("\"\"").unwrap().opaque(), b"");
    assert!(ETag::parse("W/\"x\"").unwrap().is_weak());
    assert_eq!(
        ETag::parse("\"07\"").unwrap().version(),
        None,
        "only the canonical spelling is a version"
    );
    assert_eq!(
        ETag::parse("W/\"7\"").unwrap().version(),
        None,
        "weak tags name no version"
    );
    assert_eq!(
        ETag::parse("\"7\"").unwrap().version(),
        Some(Version::new(7))
    );
    // obs-text is valid etagc.
    let mut headers = HeaderMap::new();
    headers.insert(
        "if-match",
        HeaderValue::from_bytes(b"\"\xe9t\xe9\"").unwrap(),
    );
    let list = ETagList::from_headers(&headers, &http::header::IF_MATCH)
        .unwrap()
        .unwrap();
    assert!(matches!(list, ETagList::Tags(ref tags) if tags[0].opaque() == b"\xe9t\xe9"));
    for bad in ["", "x", "\"", "W/x", "\"a\"b\"", "\"tab\there\"", " \"1\""] {
        assert!(ETag::parse(bad).is_err(), "{bad:?} was accepted");
    }
    assert_eq!(ETag::weak("v1").unwrap().to_header_value(), "W/\"v1\"");
}
