//! Property tests (seeded random loops, no server) of everything that parses user input:
//! mount option lists, volume handles, volume contexts, StorageClass parameters, secrets and
//! whole NodePublish inputs. Properties: nothing panics, whatever is accepted satisfies the
//! documented invariants, every rejection names the offending field, secrets never appear
//! in errors, Debug output or the mounter's argv, and what the node service validated is
//! exactly what the mounter will run (the argv parses back to the same configuration).
//!
//! `S3CSI_FULL=1` runs 20x more cases; `S3CSI_SEED=N` replays.

use crate::common;

use clap::Parser;
use common::{full_run, Rng};
use s3csi::config::volume::{
    Credentials, PublishInput, PublishSpec, StorageClassParams, VolumeContext, VolumeHandle,
};
use s3csi::config::Endpoint;
use s3csi::config::{BucketSource, MountConfig, MountOptionError};
use std::collections::HashMap;

fn cases() -> usize {
    if full_run() {
        200_000
    } else {
        10_000
    }
}

/// Pieces that make interesting option strings: real names, near misses, odd values.
const NAMES: &[&str] = &[
    "endpoint-url",
    "endpoint_url",
    "endpoint",
    "region",
    "force-path-style",
    "prefix",
    "read-only",
    "ro",
    "rw",
    "uid",
    "gid",
    "file-mode",
    "dir_mode",
    "allow-other",
    "allow_root",
    "metadata-ttl",
    "part-size",
    "max-concurrency",
    "max-prefetch-memory",
    "debug",
    "defaults",
    "_netdev",
    "nofail",
    "bogus",
    "UID",
    "",
    " ",
    "uid ",
    "=",
    "--uid",
    "endpoint-url\n",
    "prefix/..",
];
const VALUES: &[&str] = &[
    "",
    "0",
    "1",
    "-1",
    "true",
    "false",
    "yes",
    "maybe",
    "0644",
    "0o755",
    "999",
    "7777",
    "4294967295",
    "4294967294",
    "99999999999999999999",
    "5MiB",
    "5M",
    "4MiB",
    "5GiB",
    "6GiB",
    "8",
    "1.5",
    "500ms",
    "1e309",
    "NaN",
    "-0",
    "1h",
    "100000000h",
    "2s ",
    " 3 ",
    "http://127.0.0.1:9000",
    "https://s3.example",
    "ftp://x",
    "javascript:alert(1)",
    "eu-west-1",
    "eu west",
    "a/b",
    "../x",
    "a/../b",
    "/",
    "//",
    "a//b",
    "\u{0}",
    "\n",
    "é",
    "💾",
    "a,b",
    "a=b",
];

fn random_option_list(rng: &mut Rng) -> String {
    let n = rng.below(6);
    let mut items = Vec::new();
    for _ in 0..n {
        let long = "x".repeat(300);
        let name = if rng.chance(0.02) {
            long.as_str()
        } else {
            *rng.pick(NAMES)
        };
        items.push(match rng.below(3) {
            0 => name.to_string(),
            _ => format!("{name}={}", rng.pick(VALUES)),
        });
    }
    items.join(if rng.chance(0.9) { "," } else { ",," })
}

fn check_invariants(c: &MountConfig) {
    const MIB: u64 = 1024 * 1024;
    assert!((5 * MIB..=5 * 1024 * MIB).contains(&c.part_size), "{c:?}");
    assert!((1..=256).contains(&c.max_concurrency), "{c:?}");
    assert!(c.max_prefetch_memory >= 8 * MIB, "{c:?}");
    assert!(c.file_mode <= 0o777 && c.dir_mode <= 0o777, "{c:?}");
    assert!(c.uid != u32::MAX && c.gid != u32::MAX, "{c:?}");
    let p = &c.source.prefix;
    assert!(
        p.is_empty() || (p.ends_with('/') && !p.starts_with('/')),
        "{p:?}"
    );
    assert!(
        !p.split('/').any(|s| s == ".." || s == "."),
        "prefix {p:?} has dot components"
    );
    assert!(!p.contains("//"), "{p:?}");
    if let Some(u) = &c.endpoint.endpoint_url {
        assert!(
            u.starts_with("http://") || u.starts_with("https://"),
            "{u:?}"
        );
    }
    if let Some(r) = &c.endpoint.region {
        assert!(
            !r.is_empty() && r.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'),
            "{r:?}"
        );
    }
}

#[test]
fn random_option_lists_never_panic_and_accepted_ones_are_valid() {
    let mut rng = Rng::from_env("option_lists", 11);
    let (mut ok, mut err) = (0, 0);
    for _ in 0..cases() {
        let list = random_option_list(&mut rng);
        let mut c = MountConfig::new(BucketSource::parse("bucket").unwrap());
        match c.apply_option_list(&list) {
            Ok(()) => {
                ok += 1;
                check_invariants(&c);
            }
            Err(e) => {
                err += 1;
                let msg = e.to_string();
                let named = match &e {
                    MountOptionError::Unknown(n) => n.clone(),
                    MountOptionError::Invalid { option, .. } => option.clone(),
                    MountOptionError::BadSource(s) => s.clone(),
                };
                assert!(msg.contains(&format!("{named:?}")), "{list:?}: {msg}");
                assert!(
                    list.contains(named.trim()) || list.replace('_', "-").contains(named.trim()),
                    "{list:?}: error names {named:?}, not from the input"
                );
            }
        }
    }
    eprintln!("option lists: {ok} accepted, {err} rejected, none panicked");
    assert!(ok > 100 && err > 100);
}

/// clap front end exactly as `s3csi mount` has it.
#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    mount: s3csi::config::MountArgs,
}

#[test]
fn what_the_node_validates_is_what_the_mounter_runs() {
    let mut rng = Rng::from_env("publish_round_trip", 12);
    let (mut ok, mut err) = (0, 0);
    let secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYSECRETKEY";
    // Fixed cases first: PV mount options that contradict what the driver derives.
    // (volume context, PV mount options)
    type Case<'a> = (Vec<(&'a str, &'a str)>, Vec<&'a str>);
    let fixed: Vec<Case> = vec![
        (
            vec![("endpointUrl", "http://a.example")],
            vec!["endpoint-url=http://b.example"],
        ),
        (vec![("region", "eu-west-1")], vec!["region=us-east-2"]),
        (
            vec![("forcePathStyle", "true")],
            vec!["force-path-style=false"],
        ),
        (vec![], vec!["allow-other=false"]),
        (vec![], vec!["ro=false"]),
    ];
    for (ctx, flags) in &fixed {
        let ctx: HashMap<String, String> = ctx
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let flags: Vec<String> = flags.iter().map(|f| f.to_string()).collect();
        let none = HashMap::new();
        let spec = PublishSpec::parse(PublishInput {
            volume_id: "bkt",
            volume_context: &ctx,
            publish_context: &none,
            secrets: &none,
            mount_flags: &flags,
            volume_mount_group: "",
            read_only: false,
            defaults: &Endpoint::default(),
        })
        .unwrap();
        let mut argv = vec!["s3csi".to_string()];
        argv.extend(spec.mount_args());
        argv.push(spec.source_arg());
        argv.push("/mnt/target".into());
        let got = Cli::try_parse_from(&argv)
            .unwrap()
            .mount
            .to_config()
            .unwrap();
        assert_eq!(got, spec.config, "{ctx:?} {flags:?}: {argv:?}");
    }
    for i in 0..cases() / 4 {
        let mut ctx = HashMap::new();
        for _ in 0..rng.below(4) {
            let k = *rng.pick(&[
                "bucket",
                "prefix",
                "region",
                "endpointUrl",
                "forcePathStyle",
                "csi.storage.k8s.io/pod.name",
                "endpointURL",
                "storage.kubernetes.io/x",
            ]);
            let v = *rng.pick(VALUES);
            ctx.insert(k.to_string(), v.to_string());
        }
        if rng.chance(0.5) {
            ctx.insert("bucket".into(), "bkt".into());
        }
        let flags: Vec<String> = (0..rng.below(3))
            .map(|_| random_option_list(&mut rng))
            .collect();
        let mut secrets = HashMap::new();
        if rng.chance(0.3) {
            secrets.insert("accessKeyId".to_string(), "AKIDPROPTEST".to_string());
            secrets.insert("secretAccessKey".to_string(), secret.to_string());
        } else if rng.chance(0.1) {
            secrets.insert("secretAccessKey".to_string(), secret.to_string());
        }
        let volume_id = *rng.pick(&["bkt", "bkt/p", "bkt/a/b", "bkt/../x", "Bkt", "", "bkt//x"]);
        let group = *rng.pick(&["", "1000", "abc", "4294967295", "-1", " 7 "]);
        let none = HashMap::new();
        let defaults = Endpoint::default();
        let res = PublishSpec::parse(PublishInput {
            volume_id,
            volume_context: &ctx,
            publish_context: &none,
            secrets: &secrets,
            mount_flags: &flags,
            volume_mount_group: group,
            read_only: rng.chance(0.3),
            defaults: &defaults,
        });
        match res {
            Err(e) => {
                err += 1;
                let msg = e.to_string();
                assert!(
                    !msg.contains(secret) && !msg.contains("AKIDPROPTEST"),
                    "{msg}"
                );
            }
            Ok(spec) => {
                ok += 1;
                check_invariants(&spec.config);
                let dbg = format!("{spec:?}");
                assert!(
                    !dbg.contains(secret) && !dbg.contains("AKIDPROPTEST"),
                    "{dbg}"
                );
                let args = spec.mount_args();
                assert!(
                    !args
                        .iter()
                        .any(|a| a.contains(secret) || a.contains("AKIDPROPTEST")),
                    "{args:?}"
                );
                // The mounter's own parser accepts the argv and ends up with the same config.
                let mut argv = vec!["s3csi".to_string()];
                argv.extend(args.iter().cloned());
                argv.push(spec.source_arg());
                argv.push("/mnt/target".into());
                let cli = Cli::try_parse_from(&argv)
                    .unwrap_or_else(|e| panic!("case {i}: mounter rejects {argv:?}: {e}"));
                let got = cli
                    .mount
                    .to_config()
                    .unwrap_or_else(|e| panic!("case {i}: mounter rejects {argv:?}: {e}"));
                assert_eq!(got, spec.config, "case {i}: {argv:?}");
            }
        }
    }
    eprintln!("publish inputs: {ok} accepted and round-tripped through argv, {err} rejected");
    assert!(ok > 50 && err > 50);
}

#[test]
fn handles_contexts_and_storage_classes_never_panic() {
    let mut rng = Rng::from_env("handles", 13);
    let alphabet = [
        "a", "b", "-", ".", "/", "..", "_", "A", "0", " ", "\n", "é", "%2e", ":",
    ];
    let (mut ok, mut err) = (0, 0);
    for _ in 0..cases() {
        let s: String = (0..rng.below(12)).map(|_| *rng.pick(&alphabet)).collect();
        let s = format!("{}{s}", rng.pick(&["bkt", "", "bk", "x.y-z"]));
        match VolumeHandle::parse(&s) {
            Ok(h) => {
                ok += 1;
                // The handle is canonical: printing and parsing again gives the same.
                assert_eq!(VolumeHandle::parse(&h.id()).unwrap(), h, "{s:?}");
                assert!(!h.prefix.split('/').any(|p| p == ".." || p == "."), "{s:?}");
            }
            Err(e) => {
                err += 1;
                assert!(e.to_string().contains("volume handle"), "{s:?}: {e}");
            }
        }
        let mut ctx = HashMap::new();
        ctx.insert(
            rng.pick(&["bucket", "prefix", "basePrefix", "region", "nope", "a/b"])
                .to_string(),
            s.clone(),
        );
        let key = ctx.keys().next().unwrap().clone();
        match VolumeContext::parse(&ctx) {
            Ok(c) => {
                if let Some(p) = &c.prefix {
                    assert!(p.is_empty() || p.ends_with('/'), "{p:?}");
                }
            }
            Err(e) => {
                let m = e.to_string();
                let names_it = m.contains(&key)
                    || (key == "region" && m.contains("region"))
                    || m.contains(&key.replace("Url", "-url"));
                assert!(names_it, "{ctx:?}: {m}");
            }
        }
        if let Ok(sc) = StorageClassParams::parse(&ctx) {
            let name: String = (0..rng.below(200)).map(|_| *rng.pick(&alphabet)).collect();
            if let Ok(h) = sc.volume_for(&name) {
                // The per-PVC prefix is one clean component under basePrefix.
                let leaf = h.prefix[sc.base_prefix.len()..].trim_end_matches('/');
                assert!(!leaf.is_empty() && !leaf.contains('/') && leaf != "." && leaf != "..");
                assert_eq!(VolumeHandle::parse(&h.id()).unwrap(), h);
            }
        }
    }
    eprintln!("volume handles: {ok} accepted, {err} rejected");
}

#[test]
fn huge_inputs_are_rejected_or_parsed_quickly() {
    let start = std::time::Instant::now();
    let mib = "a".repeat(1 << 20);
    assert!(VolumeHandle::parse(&format!("bkt/{mib}")).is_err());
    assert!(VolumeHandle::parse(&mib).is_err());
    let mut c = MountConfig::new(BucketSource::parse("bkt").unwrap());
    let err = c.apply_option_list(&format!("uid={mib}")).unwrap_err();
    assert!(err.to_string().len() < 2 << 20);
    let many: HashMap<String, String> = (0..10_000)
        .map(|i| (format!("example.com/k{i}"), mib[..100].to_string()))
        .collect();
    assert!(VolumeContext::parse(&many).is_ok());
    let mut unknown = many.clone();
    unknown.insert("zzz".into(), "1".into());
    assert!(VolumeContext::parse(&unknown)
        .unwrap_err()
        .to_string()
        .contains("zzz"));
    let flags: Vec<String> = (0..10_000).map(|_| "allow-other".to_string()).collect();
    let none = HashMap::new();
    let spec = PublishSpec::parse(PublishInput {
        volume_id: "bkt",
        volume_context: &none,
        publish_context: &none,
        secrets: &none,
        mount_flags: &flags,
        volume_mount_group: "",
        read_only: false,
        defaults: &Endpoint::default(),
    })
    .unwrap();
    assert!(spec.config.allow_other);
    assert!(
        start.elapsed() < std::time::Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn credentials_never_show_in_debug_or_errors() {
    let c = Credentials::new("AKIDSHOWN", "secret-value-xyz", Some("session-token-xyz"));
    let dbg = format!("{c:?} {c:#?}");
    for s in ["AKIDSHOWN", "secret-value-xyz", "session-token-xyz"] {
        assert!(!dbg.contains(s), "{dbg}");
    }
    let secrets = HashMap::from([("sessionToken".to_string(), "session-token-xyz".to_string())]);
    let e = Credentials::from_secrets(&secrets).unwrap_err();
    assert!(!format!("{e} {e:?}").contains("session-token-xyz"));
    let secrets = HashMap::from([("accessKeyId".to_string(), "AKIDSHOWN".to_string())]);
    let e = Credentials::from_secrets(&secrets).unwrap_err();
    assert!(!format!("{e} {e:?}").contains("AKIDSHOWN"));
}
