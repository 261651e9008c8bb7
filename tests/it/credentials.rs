//! Credentials over a mount's lifetime, against real servers: moto's STS
//! (AssumeRoleWithWebIdentity) and moto's IAM with authentication enforced.
//!
//! - A web identity token file (IRSA) is read again when the session it bought runs out,
//!   so a rotated token is used and the mount keeps working.
//! - Credentials that S3 refuses, or that cannot be obtained any more, make file operations
//!   fail promptly with EACCES (EIO where a write is reported at close), with one clear line
//!   in the mounter's log naming the cause, and no secret in it.
//!
//! moto's STS answers with the lifetime asked in `DurationSeconds`, which the SDK does not
//! send (moto's default is an hour); the proxy in front of STS adds `DurationSeconds=15`
//! to each AssumeRoleWithWebIdentity request, so sessions run out within a test and the
//! SDK's identity cache renews them 5–10 s before they expire.
//!
//! What moto 5.2.1 cannot do, and what stands in for it: it accepts any web identity
//! token and never rejects an expired STS session (the proxy answers as STS and S3 do:
//! 400 ExpiredTokenException, 400 ExpiredToken); with authentication on it fails
//! unsigned STS calls with a 500, and rejects correct signatures of requests whose query
//! has an escaped `/` (every ListObjectsV2 with a delimiter), so the revocation test turns
//! authentication on only when the key is deleted.

use crate::common;

use common::fault_proxy::FaultProxy;
use common::*;
use std::fs;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const ROLE_ARN: &str = "arn:aws:iam::123456789012:role/s3csi-irsa";
/// Lifetime of each web identity session moto issues in these tests.
const SESSION_SECS: u32 = 15;
/// Inherited variables that would take precedence over web identity in the default chain.
const STATIC_CREDENTIALS: &[&str] = &[
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_PROFILE",
];
/// The longest a failing file operation may take: one S3 or STS round trip on loopback,
/// no retry loop, no hang.
const PROMPT: Duration = Duration::from_secs(5);

/// A form parameter of an `application/x-www-form-urlencoded` body, decoded.
fn form_param(body: &[u8], name: &str) -> Option<String> {
    let text = std::str::from_utf8(body).ok()?;
    let raw = text
        .split('&')
        .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))?;
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8(out).ok()
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case(name))
        .map(|(_, v)| v.as_str())
}

/// The access key id a SigV4 request was signed with (`Credential=AKID/date/...`).
fn access_key_of(headers: &[(String, String)]) -> Option<String> {
    let auth = header(headers, "authorization")?;
    let cred = auth.split("Credential=").nth(1)?;
    Some(cred.split('/').next()?.to_string())
}

/// Replaces the token file atomically, as the kubelet does for projected volumes.
fn write_token(path: &Path, token: &str) {
    let tmp = path.with_extension("new");
    fs::write(&tmp, token).unwrap();
    fs::rename(&tmp, path).unwrap();
}

/// A raw HTTP error answer with an XML body (no body for HEAD requests).
fn xml_answer(status: &str, xml: &str, method: &str) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/xml\r\nx-amz-request-id: CREDTEST\r\n\
         Content-Length: {}\r\n\r\n",
        if method == "HEAD" { 0 } else { xml.len() }
    )
    .into_bytes();
    if method != "HEAD" {
        out.extend_from_slice(xml.as_bytes());
    }
    out
}

/// What the proxy in front of STS and S3 saw.
#[derive(Default)]
struct Seen {
    /// `WebIdentityToken` of each AssumeRoleWithWebIdentity, in order.
    tokens: Vec<String>,
    /// The access key id of each signed S3 request, in order.
    s3_keys: Vec<String>,
}

/// A proxy to the shared moto for both S3 and STS that records tokens and signing keys,
/// asks STS for [`SESSION_SECS`] sessions, and answers a token starting with `expired`
/// with STS's own refusal (HTTP 400 ExpiredTokenException, as for an outdated token file).
fn sts_proxy() -> (Arc<FaultProxy>, Arc<Mutex<Seen>>) {
    let proxy = FaultProxy::start(&s3().endpoint, 1);
    let seen = Arc::new(Mutex::new(Seen::default()));
    let log = seen.clone();
    proxy.set_hook(move |req, headers, body| {
        let action = form_param(body, "Action");
        if req.method == "POST" && action.as_deref() == Some("AssumeRoleWithWebIdentity") {
            let token = form_param(body, "WebIdentityToken").unwrap_or_default();
            log.lock().unwrap().tokens.push(token.clone());
            if token.starts_with("expired") {
                return Some(xml_answer(
                    "400 Bad Request",
                    "<ErrorResponse xmlns=\"https://sts.amazonaws.com/doc/2011-06-15/\"><Error>\
                     <Type>Sender</Type><Code>ExpiredTokenException</Code><Message>Token \
                     expired: current date/time 1700000600 must be before the expiration \
                     date/time 1700000000</Message></Error><RequestId>CREDTEST</RequestId>\
                     </ErrorResponse>",
                    &req.method,
                ));
            }
            body.extend_from_slice(format!("&DurationSeconds={SESSION_SECS}").as_bytes());
            return None;
        }
        if let Some(key) = access_key_of(headers) {
            log.lock().unwrap().s3_keys.push(key);
        }
        None
    });
    (proxy, seen)
}

/// A mount whose only credentials are the web identity token in `token_file`, exchanged at
/// the proxy's STS.
fn mount_with_web_identity(
    proxy: &FaultProxy,
    bucket: &str,
    token_file: &Path,
    extra: &[&str],
) -> Mount {
    let endpoint = proxy.endpoint();
    Mount::try_start_env(
        &endpoint,
        bucket,
        extra,
        &[
            ("AWS_WEB_IDENTITY_TOKEN_FILE", token_file.to_str().unwrap()),
            ("AWS_ROLE_ARN", ROLE_ARN),
            ("AWS_ROLE_SESSION_NAME", "s3csi-test"),
            ("AWS_ENDPOINT_URL_STS", &endpoint),
            ("AWS_CONFIG_FILE", "/nonexistent/s3csi-test"),
            ("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/s3csi-test"),
        ],
        STATIC_CREDENTIALS,
    )
    .unwrap_or_else(|e| panic!("{e}"))
}

fn write_checked(path: &Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let mut f = fs::File::create(path)?;
    f.write_all(data)?;
    close_checked(f)
}

/// Runs `op`, returning its result and how long it took.
fn timed<T>(op: impl FnOnce() -> T) -> (T, Duration) {
    let start = Instant::now();
    let r = op();
    (r, start.elapsed())
}

fn errno<T: std::fmt::Debug>(r: std::io::Result<T>) -> i32 {
    r.expect_err("operation should fail")
        .raw_os_error()
        .unwrap()
}

fn lines_with(log: &str, needle: &str) -> usize {
    log.lines().filter(|l| l.contains(needle)).count()
}

#[test]
fn web_identity_token_file_is_reread_when_it_rotates() {
    let bucket = new_bucket("irsa-rotate");
    let (proxy, seen) = sts_proxy();
    let dir = scratch_dir("irsa-rotate");
    let token_file = dir.join("token");
    let pid = std::process::id();
    let (token_a, token_b) = (format!("token-a-{pid}"), format!("token-b-{pid}"));
    write_token(&token_file, &token_a);
    let m = mount_with_web_identity(&proxy, &bucket, &token_file, &[]);

    write_checked(&m.path("before.txt"), b"signed with token A's session").unwrap();
    assert_eq!(
        fs::read(m.path("before.txt")).unwrap(),
        b"signed with token A's session"
    );
    let keys_a: Vec<String> = {
        let s = seen.lock().unwrap();
        assert!(!s.tokens.is_empty(), "the mount never called STS");
        assert!(s.tokens.iter().all(|t| *t == token_a), "{:?}", s.tokens);
        s.s3_keys.clone()
    };
    assert!(!keys_a.is_empty());

    // Rotate, and keep writing while token A's session runs out: every write must succeed
    // (the SDK refreshes ahead of expiry), and STS must be asked with token B.
    let rotated = Instant::now();
    write_token(&token_file, &token_b);
    let mut during = 0;
    while !seen.lock().unwrap().tokens.contains(&token_b) {
        assert!(
            rotated.elapsed() < Duration::from_secs(3 * SESSION_SECS as u64),
            "STS never saw the rotated token: {:?}",
            seen.lock().unwrap().tokens
        );
        let name = format!("during-{during}.txt");
        write_checked(&m.path(&name), name.as_bytes())
            .unwrap_or_else(|e| panic!("write {name} while the session was refreshed: {e}"));
        during += 1;
        std::thread::sleep(Duration::from_millis(500));
    }
    let refreshed_after = rotated.elapsed();

    // Work on with token B's session.
    let first_after = seen.lock().unwrap().s3_keys.len();
    write_checked(&m.path("after.txt"), b"signed with token B's session").unwrap();
    assert_eq!(
        fs::read(m.path("after.txt")).unwrap(),
        b"signed with token B's session"
    );
    let names: Vec<String> = fs::read_dir(&m.dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .collect();
    assert!(names.contains(&"before.txt".to_string()) && names.contains(&"after.txt".to_string()));
    assert_eq!(
        s3_get(&bucket, "after.txt").unwrap(),
        b"signed with token B's session"
    );
    for i in 0..during {
        let name = format!("during-{i}.txt");
        assert_eq!(s3_get(&bucket, &name).unwrap(), name.as_bytes());
    }

    let s = seen.lock().unwrap();
    let first_b = s.tokens.iter().position(|t| *t == token_b).unwrap();
    assert!(
        s.tokens[first_b..].iter().all(|t| *t == token_b),
        "token A used again after rotation: {:?}",
        s.tokens
    );
    let keys_b = &s.s3_keys[first_after..];
    assert!(!keys_b.is_empty());
    assert!(
        keys_b.iter().all(|k| !keys_a.contains(k)),
        "S3 requests after the refresh still signed with token A's session keys"
    );
    let log = m.log_text();
    assert!(
        !log.contains(&token_a) && !log.contains(&token_b),
        "token in log:\n{log}"
    );
    eprintln!(
        "rotation: {} STS calls ({} with token A), token B first used {:.1?} after rotation; \
         {during} writes during the refresh, all durable; {} S3 requests signed with B's sessions",
        s.tokens.len(),
        first_b,
        refreshed_after,
        keys_b.len()
    );
}

#[test]
fn sts_refusing_the_token_file_gives_eacces_with_one_clear_log_line() {
    let bucket = new_bucket("irsa-expired");
    let (proxy, seen) = sts_proxy();
    let dir = scratch_dir("irsa-expired");
    let token_file = dir.join("token");
    let pid = std::process::id();
    write_token(&token_file, &format!("token-good-{pid}"));
    // A short metadata TTL so that every probe below is a fresh lookup in S3.
    let m = mount_with_web_identity(&proxy, &bucket, &token_file, &["--metadata-ttl", "100ms"]);
    let direct = client(&bucket);
    let put = |key: &str| {
        use s3csi::s3::ObjectClient;
        runtime()
            .block_on(direct.put_object(key, bytes::Bytes::from(key.to_string())))
            .unwrap();
    };

    put("p0/x");
    assert_eq!(fs::read(m.path("p0/x")).unwrap(), b"p0/x");

    // The token file now holds a token STS refuses; once the session it bought runs out,
    // reading an object the mount has not seen fails with EACCES.
    let expired_token = format!("expired-token-{pid}");
    let stale = Instant::now();
    write_token(&token_file, &expired_token);
    let mut i = 1;
    let (failed_after, first_took) = loop {
        // Past the metadata TTL, so that the lookup below asks S3.
        std::thread::sleep(Duration::from_millis(500));
        assert!(
            stale.elapsed() < Duration::from_secs(3 * SESSION_SECS as u64),
            "still working {:?} after the token went stale",
            stale.elapsed()
        );
        let key = format!("p{i}/x");
        put(&key);
        let (r, took) = timed(|| fs::read(m.path(&key)));
        match r {
            Ok(data) => assert_eq!(data, key.as_bytes()),
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::EACCES), "{key}: {e}");
                assert!(took < PROMPT, "{key} took {took:?}");
                break (stale.elapsed(), took);
            }
        }
        i += 1;
    };
    assert!(seen.lock().unwrap().tokens.contains(&expired_token));

    // Everything that needs S3 now fails, promptly, with the same errors.
    put("q/x");
    std::thread::sleep(Duration::from_millis(200));
    let (r, took) = timed(|| fs::read(m.path("q/x")));
    assert_eq!(errno(r), libc::EACCES);
    assert!(took < PROMPT, "{took:?}");
    let (r, took) = timed(|| fs::read_dir(m.path("q")).map(|d| d.count()));
    assert_eq!(errno(r), libc::EACCES);
    assert!(took < PROMPT, "{took:?}");
    let (r, took) = timed(|| write_checked(&m.path("new.txt"), b"not durable"));
    let e = errno(r);
    assert!(
        e == libc::EIO || e == libc::EACCES,
        "write+close: errno {e}"
    );
    assert!(took < PROMPT, "{took:?}");
    assert_eq!(s3_get(&bucket, "new.txt"), None);

    let log = m.log_text();
    assert_eq!(
        lines_with(&log, "could not obtain AWS credentials"),
        1,
        "one line naming the cause:\n{log}"
    );
    let line = log
        .lines()
        .find(|l| l.contains("could not obtain AWS credentials"))
        .unwrap();
    assert!(line.contains("ExpiredTokenException"), "{line}");
    assert!(
        !log.contains(&expired_token) && !log.contains("token-good"),
        "token in log:\n{log}"
    );

    // A fresh token in the file and the mount works again, without a remount.
    let renewed = Instant::now();
    write_token(&token_file, &format!("token-renewed-{pid}"));
    put("r/x");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(fs::read(m.path("r/x")).unwrap(), b"r/x");
    write_checked(&m.path("renewed.txt"), b"durable again").unwrap();
    assert_eq!(s3_get(&bucket, "renewed.txt").unwrap(), b"durable again");
    eprintln!(
        "stale token: first EACCES {failed_after:.1?} after the token went stale \
         (operation took {first_took:?}); recovered {:.1?} after a fresh token; log line: {line}",
        renewed.elapsed()
    );
}

/// IAM over moto's query API, signed by curl (SigV4).
fn iam(endpoint: &str, key: &str, secret: &str, params: &str) -> String {
    let out = std::process::Command::new("curl")
        .args(["-s", "--aws-sigv4", "aws:amz:us-east-1:iam", "--user"])
        .arg(format!("{key}:{secret}"))
        .arg(format!("{endpoint}/"))
        .arg("--data")
        .arg(format!("{params}&Version=2010-05-08"))
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success() && !text.contains("<Error>"),
        "IAM {params}: {text}"
    );
    text
}

fn xml_field(xml: &str, tag: &str) -> String {
    let open = format!("<{tag}>");
    let start = xml
        .find(&open)
        .unwrap_or_else(|| panic!("no {tag} in {xml}"))
        + open.len();
    let end = start + xml[start..].find('<').unwrap();
    xml[start..end].to_string()
}

/// An IAM user allowed `action` on everything, and its access key.
fn iam_user(endpoint: &str, name: &str, action: &str) -> (String, String) {
    iam(
        endpoint,
        "setup",
        "setup",
        &format!("Action=CreateUser&UserName={name}"),
    );
    let policy = format!(
        "%7B%22Version%22%3A%222012-10-17%22%2C%22Statement%22%3A%5B%7B%22Effect%22%3A%22Allow\
         %22%2C%22Action%22%3A%22{action}%22%2C%22Resource%22%3A%22*%22%7D%5D%7D"
    );
    iam(
        endpoint,
        "setup",
        "setup",
        &format!("Action=PutUserPolicy&UserName={name}&PolicyName=all&PolicyDocument={policy}"),
    );
    let key = iam(
        endpoint,
        "setup",
        "setup",
        &format!("Action=CreateAccessKey&UserName={name}"),
    );
    (
        xml_field(&key, "AccessKeyId"),
        xml_field(&key, "SecretAccessKey"),
    )
}

fn curl_ok(args: &[&str]) {
    let status = std::process::Command::new("curl")
        .args(["-sf", "-o", "/dev/null"])
        .args(args)
        .status()
        .expect("curl");
    assert!(status.success(), "curl {args:?}");
}

#[test]
fn revoked_access_key_gives_eacces_promptly_with_one_clear_log_line() {
    // A moto of our own, with IAM users. moto 5.2.1 cannot check the signature of a
    // request whose query has an escaped character (it recomputes it over the decoded query,
    // so every ListObjectsV2 with `delimiter=%2F` fails with SignatureDoesNotMatch, from
    // boto3 as well): the mount works while moto accepts anything, then authentication is
    // turned on and an administrator deletes the mount's key, which moto then refuses
    // (InvalidAccessKeyId, checked before the signature).
    let moto = OwnMoto::start(&[]);
    let ep = moto.endpoint.clone();
    let (admin_key, admin_secret) = iam_user(&ep, "admin", "*");
    let (app_key, app_secret) = iam_user(&ep, "app", "s3%3A*");
    let bucket = "revoked-key";
    curl_ok(&["-X", "PUT", &format!("{ep}/{bucket}")]);
    for key in ["d0/x", "d1/x", "d2/x"] {
        curl_ok(&[
            "-X",
            "PUT",
            "-H",
            "Content-Type: application/octet-stream",
            "--data-binary",
            key,
            &format!("{ep}/{bucket}/{key}"),
        ]);
    }

    // Counts the requests each failing operation costs (no retry loop on a refusal).
    let proxy = FaultProxy::start(&ep, 1);
    let m = Mount::try_start_with(
        &proxy.endpoint(),
        bucket,
        &["--metadata-ttl", "100ms"],
        &[
            ("AWS_ACCESS_KEY_ID", &app_key),
            ("AWS_SECRET_ACCESS_KEY", &app_secret),
        ],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    write_checked(&m.path("a.txt"), b"before revocation").unwrap();
    assert_eq!(fs::read(m.path("a.txt")).unwrap(), b"before revocation");
    assert_eq!(fs::read(m.path("d0/x")).unwrap(), b"d0/x");

    curl_ok(&[
        "-X",
        "POST",
        "-H",
        "Content-Type: application/octet-stream",
        "--data-binary",
        "0",
        &format!("{ep}/moto-api/reset-auth"),
    ]);
    // An administrator deletes the mount's access key (a request moto authenticates).
    iam(
        &ep,
        &admin_key,
        &admin_secret,
        &format!("Action=DeleteAccessKey&UserName=app&AccessKeyId={app_key}"),
    );
    std::thread::sleep(Duration::from_millis(200)); // past the metadata TTL

    let requests = || {
        proxy
            .stats
            .requests
            .load(std::sync::atomic::Ordering::SeqCst)
    };
    let before = requests();
    let (r, took_read) = timed(|| fs::read(m.path("d1/x")));
    assert_eq!(errno(r), libc::EACCES);
    let read_requests = requests() - before;
    let (r, took_list) = timed(|| fs::read_dir(m.path("d2")).map(|d| d.count()));
    assert_eq!(errno(r), libc::EACCES);
    let (r, took_write) = timed(|| write_checked(&m.path("b.txt"), b"after revocation"));
    let e = errno(r);
    assert!(
        e == libc::EIO || e == libc::EACCES,
        "write+close: errno {e}"
    );
    for took in [took_read, took_list, took_write] {
        assert!(took < PROMPT, "{took:?}");
    }
    // A lookup is three HEADs (`x`, `x/`, `x_$folder$`) and a LIST, sent together (and
    // perhaps a listing of the parent); a retry loop would multiply that by the SDK's
    // attempts.
    assert!(
        read_requests <= 5,
        "{read_requests} requests for one failed read"
    );

    let log = m.log_text();
    assert_eq!(
        lines_with(&log, "S3 rejected our credentials (InvalidAccessKeyId"),
        1,
        "one line naming the cause:\n{log}"
    );
    for secret in [&app_secret, &admin_secret] {
        assert!(!log.contains(secret.as_str()), "secret in log:\n{log}");
    }
    drop(m);
    drop(moto);
    eprintln!(
        "revoked key: read EACCES in {took_read:?} ({read_requests} requests), list EACCES in \
         {took_list:?}, write+close errno {e} in {took_write:?}"
    );
}

#[test]
fn expired_session_token_answer_from_s3_gives_eacces_without_retries() {
    // moto accepts STS sessions past their expiration; real S3 then answers
    // 400 ExpiredToken, echoing the token in the body. The proxy answers so, from a switch.
    let bucket = new_bucket("expired-token");
    let direct = client(&bucket);
    for key in ["e0/x", "e1/x", "e2/x"] {
        use s3csi::s3::ObjectClient;
        runtime()
            .block_on(direct.put_object(key, bytes::Bytes::from(key.to_string())))
            .unwrap();
    }
    let session_token = format!("FwoGZXIvYXdzEXAMPLESESSIONTOKEN{}", std::process::id());
    let expired = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let proxy = FaultProxy::start(&s3().endpoint, 1);
    let answered = Arc::new(std::sync::atomic::AtomicU64::new(0));
    {
        let (expired, answered) = (expired.clone(), answered.clone());
        proxy.set_hook(move |req, headers, _body| {
            if !expired.load(std::sync::atomic::Ordering::SeqCst) {
                return None;
            }
            answered.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let token = header(headers, "x-amz-security-token").unwrap_or("");
            Some(xml_answer(
                "400 Bad Request",
                &format!(
                    "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>ExpiredToken</Code>\
                     <Message>The provided token has expired.</Message><Token-0>{token}</Token-0>\
                     <RequestId>CREDTEST</RequestId><HostId>CREDTEST</HostId></Error>"
                ),
                &req.method,
            ))
        });
    }
    let m = Mount::try_start_with(
        &proxy.endpoint(),
        &bucket,
        &["--metadata-ttl", "100ms"],
        &[("AWS_SESSION_TOKEN", &session_token)],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(fs::read(m.path("e0/x")).unwrap(), b"e0/x");

    expired.store(true, std::sync::atomic::Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(200)); // past the metadata TTL
    let (r, took_read) = timed(|| fs::read(m.path("e1/x")));
    assert_eq!(errno(r), libc::EACCES);
    let read_requests = answered.load(std::sync::atomic::Ordering::SeqCst);
    let (r, took_list) = timed(|| fs::read_dir(m.path("e2")).map(|d| d.count()));
    assert_eq!(errno(r), libc::EACCES);
    let (r, took_write) = timed(|| write_checked(&m.path("new.txt"), b"x"));
    let e = errno(r);
    assert!(
        e == libc::EIO || e == libc::EACCES,
        "write+close: errno {e}"
    );
    for took in [took_read, took_list, took_write] {
        assert!(took < PROMPT, "{took:?}");
    }
    assert!(
        read_requests <= 5,
        "{read_requests} requests for one failed read"
    );

    let log = m.log_text();
    assert_eq!(
        lines_with(&log, "S3 rejected our credentials (ExpiredToken"),
        1,
        "one line naming the cause:\n{log}"
    );
    assert!(
        !log.contains(&session_token),
        "session token in log:\n{log}"
    );
    assert!(!log.contains(SECRET_KEY), "secret in log:\n{log}");
    eprintln!(
        "expired token: read EACCES in {took_read:?} ({read_requests} requests), list EACCES \
         in {took_list:?}, write+close errno {e} in {took_write:?}"
    );
}

/// Roles of the pod-credentials tests: two allowed on the bucket, one allowed nothing.
pub const ROLE_READER: &str = "arn:aws:iam::123456789012:role/team-a-reader";
pub const ROLE_WRITER: &str = "arn:aws:iam::123456789012:role/team-b-writer";
pub const ROLE_DENIED: &str = "arn:aws:iam::123456789012:role/no-s3";
pub const ROLE_ANNOTATION: &str = "eks.amazonaws.com/role-arn";

/// What the proxy of [`role_proxy`] saw.
#[derive(Default)]
pub struct Sessions {
    /// (role, token) of each AssumeRoleWithWebIdentity, in order.
    pub assumed: Vec<(String, String)>,
    /// The role each issued access key id belongs to.
    pub role_of_key: std::collections::HashMap<String, String>,
    /// (role, or "" for a key STS did not issue) of each signed S3 request.
    pub s3_roles: Vec<String>,
}

/// A proxy to the shared moto for S3 and STS that stands in for IAM: moto 5.2.1 cannot
/// enforce policies on web identity sessions (with authentication on it fails unsigned
/// STS calls, and ListObjectsV2 with a delimiter), so the proxy forwards each
/// AssumeRoleWithWebIdentity itself, learns which access key id STS issued for which
/// role, and answers every S3 request signed by a session of [`ROLE_DENIED`] with 403
/// AccessDenied, as IAM would for a role without an S3 policy. Sessions last
/// [`SESSION_SECS`].
pub fn role_proxy() -> (Arc<FaultProxy>, Arc<Mutex<Sessions>>) {
    let proxy = FaultProxy::start(&s3().endpoint, 1);
    let seen = Arc::new(Mutex::new(Sessions::default()));
    let log = seen.clone();
    let upstream = s3().endpoint.clone();
    proxy.set_hook(move |req, headers, body| {
        if req.method == "POST"
            && form_param(body, "Action").as_deref() == Some("AssumeRoleWithWebIdentity")
        {
            let role = form_param(body, "RoleArn").unwrap_or_default();
            let token = form_param(body, "WebIdentityToken").unwrap_or_default();
            body.extend_from_slice(format!("&DurationSeconds={SESSION_SECS}").as_bytes());
            // The hook runs on the proxy's runtime: let its other connections go on (one
            // may be sending moto a body that moto waits for before it answers STS).
            let out = tokio::task::block_in_place(|| {
                std::process::Command::new("curl")
                    .args(["-s", "--max-time", "10"])
                    .args(["-H", "Content-Type: application/x-www-form-urlencoded"])
                    .arg("--data-binary")
                    .arg(String::from_utf8_lossy(body).to_string())
                    .arg(format!("{upstream}/"))
                    .output()
                    .expect("curl")
            });
            let xml = String::from_utf8_lossy(&out.stdout).to_string();
            let mut s = log.lock().unwrap();
            s.assumed.push((role.clone(), token));
            if xml.contains("<AccessKeyId>") {
                s.role_of_key.insert(xml_field(&xml, "AccessKeyId"), role);
            }
            return Some(xml_answer("200 OK", &xml, &req.method));
        }
        let key = access_key_of(headers)?;
        let mut s = log.lock().unwrap();
        let role = s.role_of_key.get(&key).cloned().unwrap_or_default();
        s.s3_roles.push(role.clone());
        (role == ROLE_DENIED).then(|| {
            xml_answer(
                "403 Forbidden",
                "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>AccessDenied</Code>\
                 <Message>User: arn:aws:sts::123456789012:assumed-role/no-s3 is not \
                 authorized to perform this action</Message><RequestId>CREDTEST</RequestId>\
                 </Error>",
                &req.method,
            )
        })
    });
    (proxy, seen)
}

/// A publish as kubelet sends it for a volume with `authenticationSource: pod`, through
/// `endpoint` (a [`role_proxy`]) for S3 and STS: pod info, and the pod's token for STS
/// unless `token` is `None`.
pub fn pod_publish_req(
    bucket: &str,
    target: &Path,
    endpoint: &str,
    (pod, namespace, service_account): (&str, &str, &str),
    token: Option<&str>,
) -> s3csi::csi::pb::NodePublishVolumeRequest {
    let mut req = common::node_service::publish_req(bucket, target);
    let ctx = &mut req.volume_context;
    ctx.insert("endpointUrl".into(), endpoint.into());
    ctx.insert("authenticationSource".into(), "pod".into());
    ctx.insert("stsEndpointUrl".into(), endpoint.into());
    ctx.insert("csi.storage.k8s.io/pod.name".into(), pod.into());
    ctx.insert("csi.storage.k8s.io/pod.namespace".into(), namespace.into());
    ctx.insert(
        "csi.storage.k8s.io/serviceAccount.name".into(),
        service_account.into(),
    );
    if let Some(t) = token {
        ctx.insert(
            "csi.storage.k8s.io/serviceAccount.tokens".into(),
            format!(
                r#"{{"sts.amazonaws.com":{{"token":"{t}","expirationTimestamp":"2030-01-01T00:00:00Z"}}}}"#
            ),
        );
    }
    req
}

/// Files named `name` below `dir`.
pub fn files_named(dir: &Path, name: &str) -> Vec<std::path::PathBuf> {
    let mut out = vec![];
    let Ok(entries) = fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() && !p.is_symlink() {
            out.extend(files_named(&p, name));
        } else if p.file_name().is_some_and(|n| n == name) {
            out.push(p);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread")]
async fn pod_credentials_give_each_service_account_its_own_role_and_mounter() {
    use common::fake_kube::FakeKube;
    use common::node_service::CsiServer;
    use s3csi::csi::pb;
    use tonic::Code;

    let dir = scratch_dir("pod-credentials");
    let kube = FakeKube::start(&dir, "test-node", s3csi_bin());
    let annotation = ROLE_ANNOTATION;
    kube.insert_service_account("team-a", "reader", &[(annotation, ROLE_READER)]);
    kube.insert_service_account("team-b", "writer", &[(annotation, ROLE_WRITER)]);
    kube.insert_service_account("team-c", "intruder", &[(annotation, ROLE_DENIED)]);
    kube.insert_service_account("team-d", "plain", &[]);
    let (proxy, seen) = role_proxy();
    let endpoint = proxy.endpoint();
    // The node service keeps the test's static keys in its environment: a pod's mounter
    // must not use them.
    let server = CsiServer::options(dir.clone())
        .env("KUBECONFIG", &kube.kubeconfig.to_string_lossy())
        .start();
    let mut node = server.node().await;
    let bucket = new_bucket("pod-credentials");
    let pid = std::process::id();
    let token = |who: &str| format!("eyJ-{who}-{pid}");
    let publish = |pod: &str, ns: &str, sa: &str, tok: Option<&str>| {
        pod_publish_req(&bucket, &server.target(pod), &endpoint, (pod, ns, sa), tok)
    };
    let target = |pod: &str| server.target(pod);

    // Two pods of one service account: one mounter, with their role.
    for pod in ["reader-0", "reader-1"] {
        node.node_publish_volume(publish(pod, "team-a", "reader", Some(&token(pod))))
            .await
            .unwrap_or_else(|e| panic!("publish {pod}: {e}\n{}", server.log_text()));
    }
    assert_eq!(
        server.mounter_pids().len(),
        1,
        "one service account, one mounter"
    );
    fs::write(target("reader-0").join("a.txt"), b"from team a").unwrap();
    assert_eq!(
        fs::read(target("reader-1").join("a.txt")).unwrap(),
        b"from team a"
    );
    let in_s3 = tokio::task::block_in_place(|| s3_get(&bucket, "a.txt"));
    assert_eq!(in_s3.unwrap(), b"from team a");

    // Another service account with another role: a mounter of its own.
    node.node_publish_volume(publish(
        "writer-0",
        "team-b",
        "writer",
        Some(&token("writer-0")),
    ))
    .await
    .unwrap_or_else(|e| panic!("publish writer-0: {e}\n{}", server.log_text()));
    assert_eq!(server.mounter_pids().len(), 2, "two roles, two mounters");
    assert_eq!(
        fs::read(target("writer-0").join("a.txt")).unwrap(),
        b"from team a"
    );
    fs::write(target("writer-0").join("b.txt"), b"from team b").unwrap();

    {
        let s = seen.lock().unwrap();
        let roles: std::collections::BTreeSet<&str> =
            s.assumed.iter().map(|(r, _)| r.as_str()).collect();
        assert_eq!(roles, [ROLE_READER, ROLE_WRITER].into(), "{:?}", s.assumed);
        for (role, tok) in &s.assumed {
            let expected = if role == ROLE_READER {
                "reader"
            } else {
                "writer-0"
            };
            assert!(tok.contains(expected), "{role} assumed with {tok}");
        }
        assert!(!s.s3_roles.is_empty());
        assert!(
            s.s3_roles
                .iter()
                .all(|r| r == ROLE_READER || r == ROLE_WRITER),
            "S3 requests signed with keys STS did not issue (the node's own?): {:?}",
            s.s3_roles
        );
    }

    // A role that may not use the bucket: PermissionDenied, and no mounter left behind.
    let err = node
        .node_publish_volume(publish(
            "intruder-0",
            "team-c",
            "intruder",
            Some(&token("intruder-0")),
        ))
        .await
        .expect_err("a role without S3 access");
    assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    assert!(err.message().contains("AccessDenied"), "{}", err.message());
    assert_eq!(server.mounter_pids().len(), 2);
    assert!(!target("intruder-0").exists());

    // No role on the service account; no token from kubelet; secrets as well.
    let err = node
        .node_publish_volume(publish(
            "plain-0",
            "team-d",
            "plain",
            Some(&token("plain-0")),
        ))
        .await
        .expect_err("no role annotation");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains("eks.amazonaws.com/role-arn"),
        "{}",
        err.message()
    );
    let err = node
        .node_publish_volume(publish("reader-2", "team-a", "reader", None))
        .await
        .expect_err("no token");
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("tokenRequests"), "{}", err.message());
    let mut both = publish("reader-3", "team-a", "reader", Some(&token("reader-3")));
    both.secrets = [
        ("accessKeyId".to_string(), "AKIDSTATIC".to_string()),
        (
            "secretAccessKey".to_string(),
            "static-secret-value".to_string(),
        ),
    ]
    .into();
    let err = node
        .node_publish_volume(both)
        .await
        .expect_err("secrets too");
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    let err = node
        .node_publish_volume(publish(
            "ghost-0",
            "team-e",
            "ghost",
            Some(&token("ghost-0")),
        ))
        .await
        .expect_err("unknown service account");
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");

    // The token is a private file of the mount, nowhere else.
    let token_files = files_named(&dir.join("state"), "pod-token");
    assert_eq!(token_files.len(), 2, "{token_files:?}");
    for f in &token_files {
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(fs::metadata(f).unwrap().permissions().mode() & 0o777, 0o600);
    }
    let all_tokens: Vec<String> = ["reader-0", "reader-1", "writer-0", "intruder-0", "plain-0"]
        .iter()
        .map(|p| token(p))
        .collect();
    for pid in server.mounter_pids() {
        for what in ["cmdline", "environ"] {
            let text = String::from_utf8_lossy(&fs::read(format!("/proc/{pid}/{what}")).unwrap())
                .to_string();
            for t in &all_tokens {
                assert!(
                    !text.contains(t.as_str()),
                    "a token in the mounter's {what}"
                );
            }
        }
    }

    // kubelet republishes with a fresh token (`requiresRepublish`): the mounter's STS
    // sessions use it from the next renewal on.
    let fresh = token("reader-0-refreshed");
    node.node_publish_volume(publish("reader-0", "team-a", "reader", Some(&fresh)))
        .await
        .unwrap();
    let refreshed = Instant::now();
    let mut writes = 0;
    while !seen
        .lock()
        .unwrap()
        .assumed
        .iter()
        .any(|(_, t)| *t == fresh)
    {
        assert!(
            refreshed.elapsed() < Duration::from_secs(3 * SESSION_SECS as u64),
            "STS never saw the republished token"
        );
        let name = format!("during-{writes}.txt");
        write_checked(&target("reader-1").join(&name), name.as_bytes()).unwrap();
        writes += 1;
        std::thread::sleep(Duration::from_millis(500));
    }
    let used_after = refreshed.elapsed();

    // The account's role changes while its pods run: their mounter keeps the role it
    // started with, and a republish says so instead of handing it a token for the other.
    kube.insert_service_account("team-a", "reader", &[(annotation, ROLE_WRITER)]);
    let err = node
        .node_publish_volume(publish(
            "reader-1",
            "team-a",
            "reader",
            Some(&token("r1-new")),
        ))
        .await
        .expect_err("a republish for another role");
    assert!(err.message().contains("other credentials"), "{err:?}");
    kube.insert_service_account("team-a", "reader", &[(annotation, ROLE_READER)]);
    assert!(token_files
        .iter()
        .all(|f| fs::read_to_string(f).unwrap() != token("r1-new")));

    let mut logs = server.log_text();
    for log in fs::read_dir(dir.join("state").join("logs"))
        .into_iter()
        .flatten()
        .flatten()
    {
        logs.push_str(&fs::read_to_string(log.path()).unwrap_or_default());
    }
    for t in all_tokens.iter().chain([&fresh]) {
        assert!(!logs.contains(t.as_str()), "a token in the logs:\n{logs}");
    }

    for pod in ["reader-0", "reader-1", "writer-0"] {
        node.node_unpublish_volume(pb::NodeUnpublishVolumeRequest {
            volume_id: bucket.clone(),
            target_path: target(pod).to_string_lossy().to_string(),
        })
        .await
        .unwrap();
    }
    assert!(server.mounter_pids().is_empty());
    assert!(files_named(&dir.join("state"), "pod-token").is_empty());
    let s = seen.lock().unwrap();
    eprintln!(
        "pod credentials: {} STS calls for {} roles; {} S3 requests, all signed by the pods' \
         sessions; the republished token used {used_after:.1?} later ({writes} writes meanwhile)",
        s.assumed.len(),
        s.role_of_key
            .values()
            .collect::<std::collections::BTreeSet<_>>()
            .len(),
        s.s3_roles.len()
    );
    drop(proxy);
}
