//! The embedded S3 server (`s3csi s3-server`, the server behind `s3csi demo`).
//!
//! The protocol checks are the calls the file system and the CSI controller make, through
//! the same `AwsClient`, plus the few raw aws-sdk-s3 calls around them; each runs against
//! the embedded server and against moto, the independent reference, so the two cannot
//! drift apart unnoticed. Then one real FUSE mount over `s3csi s3-server`, and
//! `s3csi demo` end to end.

use crate::common;

use common::{is_mountpoint, runtime, s3csi_bin, scratch_dir};
use s3csi::s3::{CompletedPart, ListRequest, ObjectClient, S3Error};
use s3csi::s3server::{self, RunningServer, ServerConfig, DEMO_ACCESS_KEY, DEMO_SECRET_KEY};
use s3csi::{config::Endpoint, s3::aws::AwsClient};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

const MIB: usize = 1024 * 1024;

/// A server the checks run against.
struct Target {
    name: &'static str,
    endpoint: String,
    access_key: &'static str,
    secret_key: &'static str,
}

fn embedded_server() -> &'static RunningServer {
    static SERVER: OnceLock<RunningServer> = OnceLock::new();
    SERVER.get_or_init(|| {
        runtime()
            .block_on(s3server::start(ServerConfig {
                listen: "127.0.0.1:0".parse().unwrap(),
                dir: scratch_dir("s3server"),
                access_key: DEMO_ACCESS_KEY.into(),
                secret_key: DEMO_SECRET_KEY.into(),
            }))
            .expect("start the embedded S3 server")
    })
}

fn embedded() -> Target {
    Target {
        name: "embedded",
        endpoint: embedded_server().endpoint(),
        access_key: DEMO_ACCESS_KEY,
        secret_key: DEMO_SECRET_KEY,
    }
}

fn moto() -> Target {
    Target {
        name: "moto",
        endpoint: common::s3().endpoint.clone(),
        access_key: common::ACCESS_KEY,
        secret_key: common::SECRET_KEY,
    }
}

impl Target {
    fn endpoint(&self) -> Endpoint {
        Endpoint {
            region: Some("us-east-1".into()),
            endpoint_url: Some(self.endpoint.clone()),
            force_path_style: true,
        }
    }

    /// The client the file system uses.
    fn client(&self, bucket: &str) -> AwsClient {
        runtime().block_on(AwsClient::with_static_credentials(
            bucket,
            &self.endpoint(),
            self.access_key,
            self.secret_key,
            None,
        ))
    }

    /// A plain aws-sdk-s3 client with the SDK's default (trailing) checksums.
    fn sdk(&self) -> aws_sdk_s3::Client {
        let creds = aws_sdk_s3::config::Credentials::new(
            self.access_key,
            self.secret_key,
            None,
            None,
            "test",
        );
        let conf = aws_sdk_s3::config::Builder::new()
            .behavior_version(aws_sdk_s3::config::BehaviorVersion::latest())
            .region(aws_sdk_s3::config::Region::new("us-east-1"))
            .endpoint_url(&self.endpoint)
            .force_path_style(true)
            .credentials_provider(creds)
            .build();
        aws_sdk_s3::Client::from_conf(conf)
    }

    fn new_bucket(&self, hint: &str) -> String {
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "{hint}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        );
        let sdk = self.sdk();
        runtime()
            .block_on(sdk.create_bucket().bucket(&name).send())
            .unwrap_or_else(|e| panic!("{}: create bucket {name}: {e:?}", self.name));
        name
    }
}

fn block<T>(f: impl std::future::Future<Output = T>) -> T {
    runtime().block_on(f)
}

/// Deterministic, non-repeating test data.
fn data(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn put(c: &AwsClient, key: &str, body: &[u8]) {
    block(c.put_object(key, bytes::Bytes::copy_from_slice(body)))
        .unwrap_or_else(|e| panic!("put {key}: {e}"));
}

fn get(c: &AwsClient, key: &str) -> Vec<u8> {
    let meta = block(c.head_object(key)).unwrap_or_else(|e| panic!("head {key}: {e}"));
    block(c.get_range(key, 0, meta.size)).unwrap().to_vec()
}

/// Every entry of a listing, page by page: (objects, prefixes) per page.
fn list_pages(
    c: &AwsClient,
    prefix: &str,
    delimiter: Option<&str>,
    max_keys: i32,
) -> Vec<(Vec<String>, Vec<String>)> {
    let mut pages = vec![];
    let mut token: Option<String> = None;
    loop {
        let page = block(c.list(ListRequest {
            prefix,
            delimiter,
            continuation: token.as_deref(),
            start_after: None,
            max_keys,
        }))
        .unwrap();
        for o in &page.objects {
            assert!(
                o.meta.etag.as_deref().is_some_and(|e| !e.is_empty()),
                "listing without an ETag for {}",
                o.key
            );
        }
        pages.push((
            page.objects.into_iter().map(|o| o.key).collect(),
            page.prefixes,
        ));
        token = page.next_token;
        if token.is_none() {
            return pages;
        }
        assert!(pages.len() < 1000, "listing does not end");
    }
}

fn list_all(c: &AwsClient, prefix: &str, delimiter: Option<&str>) -> (Vec<String>, Vec<String>) {
    let mut objects = vec![];
    let mut prefixes = vec![];
    for (o, p) in list_pages(c, prefix, delimiter, 1000) {
        objects.extend(o);
        prefixes.extend(p);
    }
    (objects, prefixes)
}

fn strs(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// Error code of an SDK failure (`NoSuchKey`, `InvalidRange`, ...).
fn code<E, R>(r: Result<impl std::fmt::Debug, aws_sdk_s3::error::SdkError<E, R>>) -> String
where
    E: aws_sdk_s3::error::ProvideErrorMetadata + std::fmt::Debug,
    R: std::fmt::Debug,
{
    match r {
        Ok(v) => panic!("expected an error, got {v:?}"),
        Err(e) => e
            .as_service_error()
            .and_then(|s| s.code())
            .map(str::to_string)
            .unwrap_or_else(|| format!("{e:?}")),
    }
}

// ---- the checks ---------------------------------------------------------------------

fn check_listing(t: &Target) {
    let bucket = t.new_bucket("list");
    let c = t.client(&bucket);
    // 12 directories of 3 files, 5 top-level files, markers and a file beside a directory.
    let mut keys = vec![];
    for d in 0..12 {
        for f in 0..3 {
            keys.push(format!("dir{d:02}/file{f}"));
        }
        keys.push(format!("top{d:02}"));
    }
    keys.extend(strs(&["dir03/", "dir05/sub/", "dir05/sub/x", "top05/y"]));
    for k in &keys {
        put(&c, k, k.as_bytes());
    }

    // Delimiter listing, every page size: common prefixes count toward max-keys, order is
    // lexicographic, nothing repeats, nothing is lost.
    let expect_prefixes: Vec<String> = (0..12)
        .map(|d| format!("dir{d:02}/"))
        .chain(std::iter::once("top05/".to_string()))
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let expect_objects: Vec<String> = (0..12).map(|d| format!("top{d:02}")).collect();
    for max in [1, 2, 3, 5, 7, 24, 25, 26, 1000] {
        let pages = list_pages(&c, "", Some("/"), max);
        let mut all: Vec<String> = vec![];
        for (o, p) in &pages {
            assert!(
                o.len() + p.len() <= max as usize,
                "{}: page of {} > max-keys {max}",
                t.name,
                o.len() + p.len()
            );
            assert!(!o.is_empty() || !p.is_empty(), "{}: empty page", t.name);
            let mut page: Vec<String> = o.iter().chain(p.iter()).cloned().collect();
            page.sort();
            all.extend(page);
        }
        let mut sorted = all.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(
            all, sorted,
            "{}: max-keys {max}: out of order or repeated",
            t.name
        );
        let mut expect: Vec<String> = expect_prefixes
            .iter()
            .chain(expect_objects.iter())
            .cloned()
            .collect();
        expect.sort();
        assert_eq!(all, expect, "{}: max-keys {max}", t.name);
        let expected_pages = expect.len().div_ceil(max as usize);
        assert_eq!(pages.len(), expected_pages, "{}: max-keys {max}", t.name);
    }

    // Inside a directory: its marker is an object, subdirectories are prefixes.
    assert_eq!(
        list_all(&c, "dir05/", Some("/")),
        (
            strs(&["dir05/file0", "dir05/file1", "dir05/file2"]),
            strs(&["dir05/sub/"])
        ),
        "{}",
        t.name
    );
    assert_eq!(
        list_all(&c, "dir03/", Some("/")),
        (
            strs(&["dir03/", "dir03/file0", "dir03/file1", "dir03/file2"]),
            vec![]
        ),
        "{}",
        t.name
    );
    // A prefix that is not a directory boundary.
    assert_eq!(
        list_all(&c, "top0", Some("/")),
        (
            (0..10).map(|d| format!("top{d:02}")).collect(),
            strs(&["top05/"])
        ),
        "{}",
        t.name
    );
    // No delimiter: every key, paginated.
    let pages = list_pages(&c, "", None, 10);
    let flat: Vec<String> = pages.into_iter().flat_map(|(o, _)| o).collect();
    let mut expect = keys.clone();
    expect.sort();
    assert_eq!(flat, expect, "{}", t.name);

    // Raw: an empty delimiter is no delimiter; encoding-type=url; KeyCount; StartAfter.
    let sdk = t.sdk();
    let out = block(
        sdk.list_objects_v2()
            .bucket(&bucket)
            .prefix("dir05/")
            .delimiter("")
            .send(),
    )
    .unwrap();
    assert_eq!(out.contents().len(), 5, "{}: empty delimiter", t.name);
    assert!(out.common_prefixes().is_empty(), "{}", t.name);
    let out = block(
        sdk.list_objects_v2()
            .bucket(&bucket)
            .delimiter("/")
            .max_keys(3)
            .send(),
    )
    .unwrap();
    assert_eq!(out.key_count(), Some(3), "{}", t.name);
    assert_eq!(out.is_truncated(), Some(true), "{}", t.name);
    let out = block(
        sdk.list_objects_v2()
            .bucket(&bucket)
            .start_after("top10")
            .send(),
    )
    .unwrap();
    let keys: Vec<&str> = out.contents().iter().filter_map(|o| o.key()).collect();
    assert_eq!(keys, vec!["top11"], "{}: start-after", t.name);
    assert_eq!(out.is_truncated(), Some(false), "{}", t.name);
}

fn check_dir_markers(t: &Target) {
    let bucket = t.new_bucket("markers");
    let c = t.client(&bucket);
    put(&c, "empty/", b"");
    put(&c, "x", b"file");
    put(&c, "x/", b"");
    put(&c, "a//b", b"double slash");
    let m = block(c.head_object("empty/")).expect("HEAD of a dir/ marker");
    assert_eq!(m.size, 0, "{}", t.name);
    assert_eq!(get(&c, "x"), b"file", "{}", t.name);
    assert_eq!(
        list_all(&c, "", Some("/")),
        (strs(&["x"]), strs(&["a/", "empty/", "x/"])),
        "{}",
        t.name
    );
    assert_eq!(
        list_all(&c, "empty/", Some("/")),
        (strs(&["empty/"]), vec![])
    );
    assert_eq!(list_all(&c, "a/", Some("/")), (vec![], strs(&["a//"])));
    assert_eq!(get(&c, "a//b"), b"double slash", "{}", t.name);
    assert_eq!(
        list_all(&c, "", None).0,
        strs(&["a//b", "empty/", "x", "x/"]),
        "{}",
        t.name
    );
    block(c.delete_object("empty/")).unwrap();
    assert_eq!(block(c.head_object("empty/")), Err(S3Error::NotFound));
    assert_eq!(
        get(&c, "x"),
        b"file",
        "{}: deleting x/ must not touch x",
        t.name
    );
    // Deleting a missing key succeeds, as on S3.
    block(c.delete_object("never-was")).unwrap();
}

fn check_ranged_get(t: &Target) {
    let bucket = t.new_bucket("range");
    let c = t.client(&bucket);
    let body = data(3 * MIB + 17, 1);
    let n = body.len() as u64;
    put(&c, "big", &body);
    for (a, b) in [
        (0, 1),
        (0, n),
        (1000, 2_000_000),
        (n - 10, n),
        (MIB as u64, 2 * MIB as u64 + 1),
    ] {
        let got = block(c.get_range("big", a, b)).unwrap();
        assert_eq!(
            &got[..],
            &body[a as usize..b as usize],
            "{}: {a}..{b}",
            t.name
        );
    }
    let sdk = t.sdk();
    let out = block(
        sdk.get_object()
            .bucket(&bucket)
            .key("big")
            .range("bytes=5-9")
            .send(),
    )
    .unwrap();
    assert_eq!(out.content_range(), Some(format!("bytes 5-9/{n}").as_str()));
    assert_eq!(out.content_length(), Some(5));
    let bytes = block(out.body.collect()).unwrap().into_bytes();
    assert_eq!(&bytes[..], &body[5..10]);
    // Suffix and open-ended ranges.
    let out = block(
        sdk.get_object()
            .bucket(&bucket)
            .key("big")
            .range("bytes=-4")
            .send(),
    )
    .unwrap();
    assert_eq!(
        &block(out.body.collect()).unwrap().into_bytes()[..],
        &body[body.len() - 4..]
    );
    let out = block(
        sdk.get_object()
            .bucket(&bucket)
            .key("big")
            .range(format!("bytes={}-", n - 3))
            .send(),
    )
    .unwrap();
    assert_eq!(out.content_length(), Some(3));
    // Errors as S3 answers them.
    assert_eq!(
        code(block(
            sdk.get_object()
                .bucket(&bucket)
                .key("big")
                .range(format!("bytes={n}-"))
                .send()
        )),
        "InvalidRange",
        "{}",
        t.name
    );
    assert_eq!(
        code(block(sdk.get_object().bucket(&bucket).key("nope").send())),
        "NoSuchKey",
        "{}",
        t.name
    );
    assert_eq!(
        code(block(
            sdk.get_object()
                .bucket("no-such-bucket-here")
                .key("k")
                .send()
        )),
        "NoSuchBucket",
        "{}",
        t.name
    );
    assert_eq!(block(c.head_object("nope")), Err(S3Error::NotFound));
    let missing = t.client("no-such-bucket-here");
    assert_eq!(
        block(missing.list(ListRequest {
            prefix: "",
            delimiter: Some("/"),
            continuation: None,
            start_after: None,
            max_keys: 10
        }))
        .map(|_| ()),
        Err(S3Error::NoSuchBucket),
        "{}",
        t.name
    );
}

fn check_multipart(t: &Target) {
    let bucket = t.new_bucket("multi");
    let c = t.client(&bucket);
    let parts_data = [data(5 * MIB, 2), data(5 * MIB, 3), data(1, 4)];
    let id = block(c.create_multipart("m/obj")).unwrap();
    let mut parts = vec![];
    for (i, p) in parts_data.iter().enumerate() {
        parts.push(
            block(c.upload_part("m/obj", &id, i as i32 + 1, bytes::Bytes::copy_from_slice(p)))
                .unwrap(),
        );
    }
    // The upload is listed while in progress.
    let sdk = t.sdk();
    let out = block(sdk.list_multipart_uploads().bucket(&bucket).send()).unwrap();
    assert!(
        out.uploads()
            .iter()
            .any(|u| u.upload_id() == Some(id.as_str()) && u.key() == Some("m/obj")),
        "{}: ListMultipartUploads",
        t.name
    );
    let meta = block(c.complete_multipart("m/obj", &id, parts.clone())).unwrap();
    let whole: Vec<u8> = parts_data.concat();
    assert_eq!(get(&c, "m/obj"), whole, "{}", t.name);
    let head = block(c.head_object("m/obj")).unwrap();
    assert_eq!(head.size, whole.len() as u64);
    let etag = head.etag.unwrap();
    assert!(
        etag.trim_matches('"').ends_with("-3"),
        "{}: ETag {etag}",
        t.name
    );
    assert_eq!(
        meta.etag.map(|e| e.trim_matches('"').to_string()),
        Some(etag.trim_matches('"').to_string())
    );
    let out = block(sdk.list_multipart_uploads().bucket(&bucket).send()).unwrap();
    assert!(
        out.uploads().is_empty(),
        "{}: completed upload still listed",
        t.name
    );

    // Abort.
    let id = block(c.create_multipart("aborted")).unwrap();
    block(c.upload_part("aborted", &id, 1, bytes::Bytes::from_static(b"x"))).unwrap();
    block(c.abort_multipart("aborted", &id)).unwrap();
    let out = block(sdk.list_multipart_uploads().bucket(&bucket).send()).unwrap();
    assert!(
        out.uploads().is_empty(),
        "{}: aborted upload still listed",
        t.name
    );
    let late = code(block(
        sdk.upload_part()
            .bucket(&bucket)
            .key("aborted")
            .upload_id(&id)
            .part_number(2)
            .body(aws_sdk_s3::primitives::ByteStream::from_static(b"y"))
            .send(),
    ));
    // S3 answers NoSuchUpload; moto fails with a 500 here, so only the code is not checked.
    if t.name != "moto" {
        assert_eq!(late, "NoSuchUpload", "{}", t.name);
    }
    assert_eq!(block(c.head_object("aborted")), Err(S3Error::NotFound));

    // Parts below 5 MiB (but the last) are refused at completion.
    let id = block(c.create_multipart("small")).unwrap();
    let p1 = block(c.upload_part("small", &id, 1, bytes::Bytes::from_static(b"a"))).unwrap();
    let p2 = block(c.upload_part("small", &id, 2, bytes::Bytes::from_static(b"b"))).unwrap();
    let r = block(
        sdk.complete_multipart_upload()
            .bucket(&bucket)
            .key("small")
            .upload_id(&id)
            .multipart_upload(completed(&[p1, p2]))
            .send(),
    );
    assert_eq!(code(r), "EntityTooSmall", "{}", t.name);
    block(c.abort_multipart("small", &id)).unwrap();

    // UploadPartCopy with ranges (what a rename above 5 GiB does).
    let src = data(7 * MIB + 5, 5);
    put(&c, "copy src", &src);
    let id = block(c.create_multipart("copied")).unwrap();
    let mut parts = vec![];
    for (n, (a, b)) in [(0, 5 * MIB), (5 * MIB, src.len())].into_iter().enumerate() {
        let out = block(
            sdk.upload_part_copy()
                .bucket(&bucket)
                .key("copied")
                .upload_id(&id)
                .part_number(n as i32 + 1)
                .copy_source(format!("{bucket}/copy%20src"))
                .copy_source_range(format!("bytes={a}-{}", b - 1))
                .send(),
        )
        .unwrap_or_else(|e| panic!("{}: UploadPartCopy: {e:?}", t.name));
        parts.push(CompletedPart {
            part_number: n as i32 + 1,
            etag: out.copy_part_result().unwrap().e_tag().unwrap().to_string(),
        });
    }
    block(c.complete_multipart("copied", &id, parts)).unwrap();
    assert_eq!(get(&c, "copied"), src, "{}", t.name);
}

fn completed(parts: &[CompletedPart]) -> aws_sdk_s3::types::CompletedMultipartUpload {
    aws_sdk_s3::types::CompletedMultipartUpload::builder()
        .set_parts(Some(
            parts
                .iter()
                .map(|p| {
                    aws_sdk_s3::types::CompletedPart::builder()
                        .part_number(p.part_number)
                        .e_tag(&p.etag)
                        .build()
                })
                .collect(),
        ))
        .build()
}

fn check_copy_and_batch_delete(t: &Target) {
    let bucket = t.new_bucket("copy");
    let c = t.client(&bucket);
    let body = data(100_000, 6);
    // Keys that need percent-encoding in x-amz-copy-source.
    put(&c, "src dir/a+b é?.bin", &body);
    block(c.copy_object("src dir/a+b é?.bin", "dst/%20x", body.len() as u64)).unwrap();
    assert_eq!(get(&c, "dst/%20x"), body, "{}", t.name);
    assert_eq!(
        block(c.head_object("dst/%20x")).unwrap().etag,
        block(c.head_object("src dir/a+b é?.bin")).unwrap().etag,
        "{}: a copy keeps the ETag of a single-part object",
        t.name
    );
    assert!(
        block(c.copy_object("missing", "dst2", 1)).is_err(),
        "{}",
        t.name
    );

    // Batch delete: existing and missing keys alike are reported deleted.
    let keys: Vec<String> = (0..30).map(|i| format!("del/k{i:02}")).collect();
    for k in &keys {
        put(&c, k, b"x");
    }
    let mut doomed: Vec<String> = keys[..25].to_vec();
    doomed.push("del/never-existed".into());
    let n = block(c.delete_objects(doomed)).unwrap();
    assert_eq!(n, 26, "{}", t.name);
    assert_eq!(
        list_all(&c, "del/", None).0,
        keys[25..].to_vec(),
        "{}",
        t.name
    );
}

fn check_buckets(t: &Target) {
    let sdk = t.sdk();
    let bucket = t.new_bucket("buckets");
    block(sdk.head_bucket().bucket(&bucket).send()).unwrap();
    let out = block(sdk.list_buckets().send()).unwrap();
    assert!(out
        .buckets()
        .iter()
        .any(|b| b.name() == Some(bucket.as_str())));
    block(
        sdk.put_object()
            .bucket(&bucket)
            .key("k")
            .body(aws_sdk_s3::primitives::ByteStream::from_static(b"v"))
            .send(),
    )
    .unwrap();
    assert_eq!(
        code(block(sdk.delete_bucket().bucket(&bucket).send())),
        "BucketNotEmpty",
        "{}",
        t.name
    );
    block(sdk.delete_object().bucket(&bucket).key("k").send()).unwrap();
    block(sdk.delete_bucket().bucket(&bucket).send()).unwrap();
    assert!(block(sdk.head_bucket().bucket(&bucket).send()).is_err());
    assert_eq!(
        code(block(sdk.delete_bucket().bucket(&bucket).send())),
        "NoSuchBucket",
        "{}",
        t.name
    );
}

macro_rules! against_both {
    ($($check:ident => $embedded:ident, $moto:ident;)*) => {$(
        #[test]
        fn $embedded() {
            $check(&embedded());
        }
        #[test]
        fn $moto() {
            $check(&moto());
        }
    )*};
}

against_both! {
    check_listing => listing_embedded, listing_moto;
    check_dir_markers => dir_markers_embedded, dir_markers_moto;
    check_ranged_get => ranged_get_embedded, ranged_get_moto;
    check_multipart => multipart_embedded, multipart_moto;
    check_copy_and_batch_delete => copy_and_batch_delete_embedded, copy_and_batch_delete_moto;
    check_buckets => buckets_embedded, buckets_moto;
}

// ---- embedded only ------------------------------------------------------------------

#[test]
fn wrong_keys_are_refused() {
    let mut t = embedded();
    t.secret_key = "not-the-secret";
    let r = block(t.sdk().list_buckets().send());
    assert_eq!(code(r), "SignatureDoesNotMatch");
    t.access_key = "someone-else";
    assert!(block(t.sdk().list_buckets().send()).is_err());
    let sdk = embedded().sdk();
    let bucket = embedded().new_bucket("again");
    assert_eq!(
        code(block(sdk.create_bucket().bucket(&bucket).send())),
        "BucketAlreadyOwnedByYou"
    );
}

#[test]
fn objects_survive_a_restart() {
    let dir = scratch_dir("s3restart");
    let start = || {
        block(s3server::start(ServerConfig {
            listen: "127.0.0.1:0".parse().unwrap(),
            dir: dir.clone(),
            access_key: DEMO_ACCESS_KEY.into(),
            secret_key: DEMO_SECRET_KEY.into(),
        }))
        .unwrap()
    };
    let server = start();
    server.store.create_bucket("keep").unwrap();
    let t = Target {
        name: "restart",
        endpoint: server.endpoint(),
        access_key: DEMO_ACCESS_KEY,
        secret_key: DEMO_SECRET_KEY,
    };
    let c = t.client("keep");
    put(&c, "d/", b"");
    put(&c, "d/f", b"one");
    put(&c, "d/f", b"two");
    put(&c, "gone", b"x");
    block(c.delete_object("gone")).unwrap();
    block(server.stop());

    let server = start();
    let t = Target {
        endpoint: server.endpoint(),
        ..t
    };
    let c = t.client("keep");
    assert_eq!(list_all(&c, "", None).0, strs(&["d/", "d/f"]));
    assert_eq!(get(&c, "d/f"), b"two");
    block(server.stop());
    // Nothing but the two objects' files and sidecars is left.
    let files = std::fs::read_dir(dir.join("buckets").join("keep"))
        .unwrap()
        .count();
    assert_eq!(files, 4);
    let _ = std::fs::remove_dir_all(&dir);
}

// ---- s3csi s3-server + s3csi mount ---------------------------------------------------

/// A child process killed (SIGKILL) if the test panics before stopping it.
struct ChildGuard(Option<Child>);

impl ChildGuard {
    /// SIGTERM (or `sig`), then waits up to `secs`; returns the exit status.
    fn stop(&mut self, sig: i32, secs: u64) -> Option<std::process::ExitStatus> {
        let mut child = self.0.take()?;
        unsafe {
            libc::kill(child.id() as i32, sig);
        }
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return Some(status);
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Reads a child's stdout lines on a thread.
fn lines_of(child: &mut Child) -> std::sync::mpsc::Receiver<String> {
    let out = child.stdout.take().expect("piped stdout");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Waits for a line containing `needle`; returns it (and everything seen, on failure).
fn wait_for_line(
    rx: &std::sync::mpsc::Receiver<String>,
    needle: &str,
    secs: u64,
) -> Result<String, String> {
    let deadline = Instant::now() + Duration::from_secs(secs);
    let mut seen = String::new();
    while Instant::now() < deadline {
        match rx.recv_timeout(Duration::from_millis(200)) {
            Ok(line) if line.contains(needle) => return Ok(line),
            Ok(line) => {
                seen.push_str(&line);
                seen.push('\n');
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(_) => return Err(format!("output ended before {needle:?}:\n{seen}")),
        }
    }
    Err(format!("no {needle:?} within {secs}s:\n{seen}"))
}

fn wait_mounted(dir: &Path, child: &mut Child, log: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !is_mountpoint(dir) {
        if let Ok(Some(status)) = child.try_wait() {
            panic!(
                "mount exited with {status}: {}",
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        assert!(Instant::now() < deadline, "mount did not appear");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn fuse_mount_over_s3_server() {
    let data_dir = scratch_dir("s3srv-data");
    let mut server = Command::new(s3csi_bin());
    server
        .args(["s3-server", "--listen", "127.0.0.1:0", "--bucket", "mnt"])
        .arg("--dir")
        .arg(&data_dir)
        .env_remove(s3server::SECRET_ENV)
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut server = ChildGuard(Some(server.spawn().expect("start s3csi s3-server")));
    let rx = lines_of(server.0.as_mut().unwrap());
    let line = wait_for_line(&rx, "listening on ", 30).unwrap();
    let endpoint = line
        .split("listening on ")
        .nth(1)
        .unwrap()
        .trim()
        .to_string();

    let mnt = scratch_dir("s3srv-mnt");
    let log = mnt.with_extension("log");
    let mut mount = Command::new(s3csi_bin());
    mount
        .args(["mount", "--foreground", "--force-path-style"])
        .args(["--endpoint-url", &endpoint, "--region", "us-east-1"])
        .arg("mnt")
        .arg(&mnt)
        .env("AWS_ACCESS_KEY_ID", DEMO_ACCESS_KEY)
        .env("AWS_SECRET_ACCESS_KEY", DEMO_SECRET_KEY)
        .env("AWS_EC2_METADATA_DISABLED", "true")
        .env_remove("AWS_PROFILE")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap());
    let mut mount = ChildGuard(Some(mount.spawn().expect("start s3csi mount")));
    wait_mounted(&mnt, mount.0.as_mut().unwrap(), &log);

    let body = data(9 * MIB + 3, 7);
    std::fs::write(mnt.join("file.bin"), &body).unwrap();
    assert_eq!(std::fs::read(mnt.join("file.bin")).unwrap(), body);
    std::fs::create_dir(mnt.join("sub")).unwrap();
    std::fs::create_dir(mnt.join("empty")).unwrap();
    std::fs::write(mnt.join("sub/small.txt"), b"small").unwrap();
    let ls = |p: &Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(p)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    };
    assert_eq!(ls(&mnt), strs(&["empty", "file.bin", "sub"]));
    std::fs::rename(mnt.join("file.bin"), mnt.join("sub/moved.bin")).unwrap();
    assert_eq!(ls(&mnt.join("sub")), strs(&["moved.bin", "small.txt"]));
    assert_eq!(std::fs::read(mnt.join("sub/moved.bin")).unwrap(), body);
    assert!(!mnt.join("file.bin").exists());

    // What S3 holds: the empty directory is a marker object.
    let t = Target {
        name: "s3-server",
        endpoint: endpoint.clone(),
        access_key: DEMO_ACCESS_KEY,
        secret_key: DEMO_SECRET_KEY,
    };
    let c = t.client("mnt");
    let (objects, _) = list_all(&c, "", None);
    assert!(objects.contains(&"empty/".to_string()), "{objects:?}");
    assert!(
        objects.contains(&"sub/moved.bin".to_string()),
        "{objects:?}"
    );
    assert!(!objects.contains(&"file.bin".to_string()), "{objects:?}");
    std::fs::remove_dir(mnt.join("empty")).unwrap();
    assert!(!mnt.join("empty").exists());

    let status = mount
        .stop(libc::SIGTERM, 30)
        .expect("mount stops on SIGTERM");
    assert!(status.success(), "mount exited with {status}");
    assert!(!is_mountpoint(&mnt));
    // Deletes after the mount's first are sent in the background; SIGTERM waits for them.
    assert!(!list_all(&c, "", None).0.contains(&"empty/".to_string()));
    let status = server
        .stop(libc::SIGTERM, 10)
        .expect("server stops on SIGTERM");
    assert!(status.success(), "s3-server exited with {status}");
    let _ = std::fs::remove_dir(&mnt);
    let _ = std::fs::remove_file(&log);
    let _ = std::fs::remove_dir_all(&data_dir);
}

// ---- s3csi demo ----------------------------------------------------------------------

#[test]
fn demo_runs_and_cleans_up() {
    let parent = scratch_dir("demo");
    let mut cmd = Command::new(s3csi_bin());
    cmd.arg("demo")
        .arg("--dir")
        .arg(&parent)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    let mut demo = ChildGuard(Some(cmd.spawn().expect("start s3csi demo")));
    let rx = lines_of(demo.0.as_mut().unwrap());
    let line = wait_for_line(&rx, "mounted at ", 90).unwrap();
    let target = PathBuf::from(line.split("mounted at ").nth(1).unwrap().trim());
    assert!(target.starts_with(&parent), "{target:?}");
    assert!(is_mountpoint(&target), "{target:?} is not a mount point");
    let hello = std::fs::read_to_string(target.join("hello.txt")).unwrap();
    assert!(hello.starts_with("Hello from s3csi"), "{hello:?}");
    std::fs::write(target.join("more.txt"), b"more").unwrap();
    assert_eq!(std::fs::read(target.join("more.txt")).unwrap(), b"more");

    let status = demo.stop(libc::SIGINT, 90).expect("demo stops on SIGINT");
    assert!(status.success(), "demo exited with {status}");
    assert!(!is_mountpoint(&target), "the mount is still there");
    // The demo removed its temporary directory.
    let left: Vec<_> = std::fs::read_dir(&parent).unwrap().collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    let _ = std::fs::remove_dir(&parent);
}
