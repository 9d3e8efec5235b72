//! OCI distribution: pull an image from a registry into the store (manifest list ->
//! linux/amd64, gzip/zstd/plain layers streamed into chunks, digests and diff_ids
//! verified), and push an image's layer stack back as an OCI image (deterministic:
//! pushing the same layers twice gives the same manifest digest).
//!
//! Transport and authentication (HTTPS, Basic or Bearer) are `registry::Client`'s.

use std::io::{Seek, Write};
use std::time::Duration;

use serde_json::{json, Value};
use tracing::info;

use crate::build::BuildStats;
use crate::digest::{Digest, HashingWriter};
use crate::error::{Error, Result};
use crate::progress::{NoProgress, Progress};
use crate::registry::Client;
use crate::store::{now_secs, ImageRecord, Store};
use crate::tarfmt;

const MT_OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
const MT_OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const MT_OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const MT_OCI_LAYER_GZIP: &str = "application/vnd.oci.image.layer.v1.tar+gzip";
const MT_DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
const MT_DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
const MAX_MANIFEST: u64 = 8 << 20;

/// `host[:port]/repo/path[:tag|@sha256:...]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reference {
    pub registry: String,
    pub repo: String,
    /// Tag or digest.
    pub reference: String,
}

impl Reference {
    pub fn parse(s: &str) -> Result<Reference> {
        let bad = |why: &str| {
            Error::Invalid(format!(
                "image reference {s:?}: {why} (expected host[:port]/repo[:tag|@sha256:digest])"
            ))
        };
        let (registry, rest) = s.split_once('/').ok_or_else(|| bad("no registry host"))?;
        if !(registry.contains('.') || registry.contains(':') || registry == "localhost") {
            return Err(bad("the first component must be a registry host"));
        }
        let (repo, reference) = if let Some((r, d)) = rest.split_once('@') {
            (r, d.to_string())
        } else {
            match rest.rsplit_once(':') {
                Some((r, t)) if !t.contains('/') => (r, t.to_string()),
                _ => (rest, "latest".to_string()),
            }
        };
        if repo.is_empty()
            || !repo
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "._-/".contains(c))
        {
            return Err(bad("repository must be lowercase letters, digits and ._-/"));
        }
        if reference.is_empty() || reference.contains('/') {
            return Err(bad("empty or invalid tag"));
        }
        Ok(Reference {
            registry: registry.to_string(),
            repo: repo.to_string(),
            reference,
        })
    }
}

impl std::fmt::Display for Reference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sep = if self.reference.starts_with("sha256:") {
            '@'
        } else {
            ':'
        };
        write!(f, "{}/{}{sep}{}", self.registry, self.repo, self.reference)
    }
}

/// Connects to the reference's registry, authenticated for `actions` (`pull`, `pull,push`)
/// on its repository.
pub fn connect(reference: &Reference, actions: &str) -> Result<Client> {
    Client::connect(&reference.registry, &reference.repo, actions)
}

/// An HTTP(S) agent trusting the system CAs (statuses handled by the caller), e.g. to wait
/// for a local registry.
pub fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(3600)))
        .tls_config(crate::registry::system_tls_config())
        .build()
        .into()
}

fn reg_err(url: &str, detail: impl std::fmt::Display) -> Error {
    Error::Registry {
        url: url.to_string(),
        detail: detail.to_string(),
    }
}

fn check_status(url: &str, resp: &mut ureq::http::Response<ureq::Body>, ok: &[u16]) -> Result<()> {
    let st = resp.status().as_u16();
    if ok.contains(&st) {
        return Ok(());
    }
    // The registry's error body names the problem (e.g. MANIFEST_BLOB_UNKNOWN).
    let body = resp
        .body_mut()
        .with_config()
        .limit(4096)
        .read_to_string()
        .unwrap_or_default();
    let body: String = body.chars().take(300).collect();
    let hint = match st {
        401 | 403 => "the registry refused the credentials or token for this repository",
        404 => "not found: check the repository and tag",
        _ => "unexpected status",
    };
    Err(reg_err(url, format!("HTTP {st}: {hint}: {}", body.trim())))
}

fn get_json(client: &Client, url: &str, accept: &str) -> Result<(Vec<u8>, Option<String>)> {
    let mut resp = client
        .get(url)
        .header("Accept", accept)
        .call()
        .map_err(|e| reg_err(url, format!("{e} (is the registry running and reachable?)")))?;
    check_status(url, &mut resp, &[200])?;
    let ct = resp
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .map(|s| s.split(';').next().unwrap_or(s).trim().to_string());
    let body = resp
        .body_mut()
        .with_config()
        .limit(MAX_MANIFEST)
        .read_to_vec()
        .map_err(|e| reg_err(url, e))?;
    Ok((body, ct))
}

fn parse_json(url: &str, bytes: &[u8]) -> Result<Value> {
    serde_json::from_slice(bytes).map_err(|e| reg_err(url, format!("invalid JSON: {e}")))
}

fn desc_digest(url: &str, v: &Value) -> Result<Digest> {
    let s = v["digest"]
        .as_str()
        .ok_or_else(|| reg_err(url, "descriptor without a digest"))?;
    Digest::parse(s)
}

/// What a pull produced.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PullReport {
    pub image: ImageRecord,
    pub manifest_digest: Digest,
    pub compressed_bytes: u64,
    /// Counters of the layers downloaded (reused layers add nothing).
    #[serde(flatten)]
    pub stats: BuildStats,
}

/// Pulls `reference` into the store as image `name`.
pub fn pull(store: &Store, reference: &Reference, name: &str) -> Result<PullReport> {
    pull_with_progress(store, reference, name, &NoProgress)
}

/// `pull`, reporting each layer, the blob bytes downloaded and the chunks stored to
/// `progress`.
pub fn pull_with_progress(
    store: &Store,
    reference: &Reference,
    name: &str,
    progress: &dyn Progress,
) -> Result<PullReport> {
    pull_with_client(
        store,
        reference,
        name,
        progress,
        &connect(reference, "pull")?,
    )
}

/// `pull_with_progress` through a client the caller connected (own CA, credentials).
pub fn pull_with_client(
    store: &Store,
    reference: &Reference,
    name: &str,
    progress: &dyn Progress,
    client: &Client,
) -> Result<PullReport> {
    let base = client.base(&reference.repo);
    let accept = [
        MT_OCI_INDEX,
        MT_DOCKER_LIST,
        MT_OCI_MANIFEST,
        MT_DOCKER_MANIFEST,
    ]
    .join(", ");
    let url = format!("{base}/manifests/{}", reference.reference);
    let (mut bytes, mut ct) = get_json(client, &url, &accept)?;
    let mut manifest_digest = Digest::of(&bytes);
    if reference.reference.starts_with("sha256:")
        && Digest::parse(&reference.reference)? != manifest_digest
    {
        return Err(reg_err(
            &url,
            "manifest does not match the requested digest",
        ));
    }
    let mut doc = parse_json(&url, &bytes)?;
    let mt = doc["mediaType"]
        .as_str()
        .map(str::to_string)
        .or(ct.clone())
        .unwrap_or_default();
    if mt == MT_OCI_INDEX || mt == MT_DOCKER_LIST || doc.get("manifests").is_some() {
        let chosen = doc["manifests"]
            .as_array()
            .and_then(|ms| {
                ms.iter().find(|m| {
                    m["platform"]["os"] == "linux" && m["platform"]["architecture"] == "amd64"
                })
            })
            .ok_or_else(|| reg_err(&url, "the manifest list has no linux/amd64 image"))?;
        let d = desc_digest(&url, chosen)?;
        let murl = format!("{base}/manifests/{d}");
        (bytes, ct) = get_json(
            client,
            &murl,
            &[MT_OCI_MANIFEST, MT_DOCKER_MANIFEST].join(", "),
        )?;
        manifest_digest = Digest::of(&bytes);
        if manifest_digest != d {
            return Err(reg_err(
                &murl,
                "manifest does not match its digest in the list",
            ));
        }
        doc = parse_json(&murl, &bytes)?;
    }
    let _ = ct;
    let cfg_digest = desc_digest(&url, &doc["config"])?;
    let curl = format!("{base}/blobs/{cfg_digest}");
    let (cfg_bytes, _) = get_json(client, &curl, "*/*")?;
    if Digest::of(&cfg_bytes) != cfg_digest {
        return Err(reg_err(&curl, "config blob does not match its digest"));
    }
    let cfg = parse_json(&curl, &cfg_bytes)?;
    let diff_ids: Vec<Digest> = cfg["rootfs"]["diff_ids"]
        .as_array()
        .ok_or_else(|| reg_err(&curl, "config has no rootfs.diff_ids"))?
        .iter()
        .map(|v| Digest::parse(v.as_str().unwrap_or("")))
        .collect::<Result<_>>()?;
    let layers = doc["layers"]
        .as_array()
        .ok_or_else(|| reg_err(&url, "manifest has no layers"))?;
    if layers.len() != diff_ids.len() {
        return Err(reg_err(
            &url,
            "manifest and config disagree on the number of layers",
        ));
    }
    let mut report = PullReport {
        image: ImageRecord {
            name: name.to_string(),
            layers: Vec::new(),
            diff_ids: diff_ids.clone(),
            config: Some(store.put_blob(&cfg_bytes)?),
            hot_list: None,
            created: now_secs(),
        },
        manifest_digest,
        compressed_bytes: 0,
        stats: BuildStats::default(),
    };
    for (i, l) in layers.iter().enumerate() {
        let d = desc_digest(&url, l)?;
        progress.layer_started(i, layers.len(), l["size"].as_u64());
        // Same uncompressed layer already imported (another image shares it): no download.
        if let Some(id) = store.layer_for_diff_id(&diff_ids[i]) {
            info!(layer = %id.short(), "layer already in the store");
            report.image.layers.push(id);
            progress.layer_finished(true);
            continue;
        }
        let mt = l["mediaType"].as_str().unwrap_or("");
        if !(mt.contains("tar") || mt.is_empty()) {
            return Err(reg_err(
                &url,
                format!("layer {d} has unsupported media type {mt}"),
            ));
        }
        let burl = format!("{base}/blobs/{d}");
        let mut resp = client.get(&burl).call().map_err(|e| reg_err(&burl, e))?;
        check_status(&burl, &mut resp, &[200])?;
        let reader = resp.into_body().into_reader();
        let imp = tarfmt::import_tar_with_progress(store, reader, progress)?;
        progress.layer_finished(false);
        if imp.blob_digest != d {
            return Err(reg_err(
                &burl,
                format!(
                    "layer blob hashes to {}, manifest says {d}",
                    imp.blob_digest
                ),
            ));
        }
        if imp.diff_id != diff_ids[i] {
            return Err(reg_err(
                &burl,
                format!(
                    "uncompressed layer hashes to {}, config says {}",
                    imp.diff_id, diff_ids[i]
                ),
            ));
        }
        info!(layer = %imp.layer.short(), blob = %d.short(), bytes = imp.blob_size, "layer imported");
        report.compressed_bytes += imp.blob_size;
        report.stats.add(&imp.stats);
        store.record_diff_id(&imp.diff_id, &imp.layer)?;
        report.image.layers.push(imp.layer);
    }
    store.put_image(&report.image)?;
    Ok(report)
}

/// Uploads one blob unless the registry already has it.
pub fn upload_blob(
    client: &Client,
    base: &str,
    digest: &Digest,
    body: impl ureq::AsSendBody,
) -> Result<()> {
    let head = format!("{base}/blobs/{digest}");
    if let Ok(r) = client.head(&head).call() {
        if r.status().as_u16() == 200 {
            return Ok(());
        }
    }
    let start = format!("{base}/blobs/uploads/");
    let mut resp = client
        .post(&start)
        .send_empty()
        .map_err(|e| reg_err(&start, e))?;
    check_status(&start, &mut resp, &[202])?;
    let loc = resp
        .headers()
        .get("location")
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| reg_err(&start, "upload started without a Location"))?;
    let loc = if loc.starts_with("http") {
        loc.to_string()
    } else {
        let host = base.splitn(4, '/').take(3).collect::<Vec<_>>().join("/");
        format!("{host}{loc}")
    };
    let sep = if loc.contains('?') { '&' } else { '?' };
    let put = format!("{loc}{sep}digest={digest}");
    let mut resp = client
        .put(&put)
        .header("Content-Type", "application/octet-stream")
        .send(body)
        .map_err(|e| reg_err(&put, e))?;
    check_status(&put, &mut resp, &[201])
}

/// What a push produced.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PushReport {
    pub reference: String,
    pub manifest_digest: Digest,
    pub layers: Vec<Digest>,
    pub diff_ids: Vec<Digest>,
}

/// Pushes image `name` to `reference` as an OCI image with gzip layers.
pub fn push(store: &Store, name: &str, reference: &Reference) -> Result<PushReport> {
    push_with_client(store, name, reference, &connect(reference, "pull,push")?)
}

/// `push` through a client the caller connected (own CA, credentials).
pub fn push_with_client(
    store: &Store,
    name: &str,
    reference: &Reference,
    client: &Client,
) -> Result<PushReport> {
    let img = store.get_image(name)?;
    let base = client.base(&reference.repo);
    let mut layer_descs = Vec::new();
    let mut diff_ids = Vec::new();
    let mut blob_digests = Vec::new();
    for id in &img.layers {
        let index = store.get_layer(id)?;
        let mut tmp = tempfile_in(store)?;
        // gzip over the tar, hashing both: blob digest and diff_id in one pass.
        let (diff_id, blob_digest, size) = {
            let blob_hasher = HashingWriter::new(&mut tmp);
            let gz = flate2::GzBuilder::new()
                .mtime(0)
                .write(blob_hasher, flate2::Compression::fast());
            let mut tar_hasher = HashingWriter::new(gz);
            tarfmt::export_tar(store, &index, &mut tar_hasher)?;
            let (gz, diff_id, _) = tar_hasher.finish();
            let blob_hasher = gz.finish().map_err(|e| Error::Oci(format!("gzip: {e}")))?;
            let (_, blob_digest, size) = blob_hasher.finish();
            (diff_id, blob_digest, size)
        };
        tmp.flush()
            .map_err(|e| Error::Oci(format!("temp file: {e}")))?;
        tmp.rewind()
            .map_err(|e| Error::Oci(format!("temp file: {e}")))?;
        upload_blob(client, &base, &blob_digest, &tmp)?;
        layer_descs.push(json!({"mediaType": MT_OCI_LAYER_GZIP, "digest": blob_digest.to_string(), "size": size}));
        diff_ids.push(diff_id);
        blob_digests.push(blob_digest);
    }
    // Keep the original config (entrypoint, env, ...) but point it at the layers pushed.
    let mut cfg: Value = match img.config {
        Some(c) => serde_json::from_slice(&store.get_blob(&c)?)
            .map_err(|e| Error::Oci(format!("stored image config is not JSON: {e}")))?,
        None => json!({"architecture": "amd64", "os": "linux", "config": {}}),
    };
    cfg["rootfs"] = json!({"type": "layers", "diff_ids": diff_ids.iter().map(|d| d.to_string()).collect::<Vec<_>>()});
    let cfg_bytes = serde_json::to_vec(&cfg).expect("config serializes");
    let cfg_digest = Digest::of(&cfg_bytes);
    upload_blob(client, &base, &cfg_digest, &cfg_bytes[..])?;
    let manifest = json!({
        "schemaVersion": 2,
        "mediaType": MT_OCI_MANIFEST,
        "config": {"mediaType": MT_OCI_CONFIG, "digest": cfg_digest.to_string(), "size": cfg_bytes.len()},
        "layers": layer_descs,
    });
    let mbytes = serde_json::to_vec(&manifest).expect("manifest serializes");
    let murl = format!("{base}/manifests/{}", reference.reference);
    let mut resp = client
        .put(&murl)
        .header("Content-Type", MT_OCI_MANIFEST)
        .send(&mbytes[..])
        .map_err(|e| reg_err(&murl, e))?;
    check_status(&murl, &mut resp, &[201])?;
    Ok(PushReport {
        reference: reference.to_string(),
        manifest_digest: Digest::of(&mbytes),
        layers: blob_digests,
        diff_ids,
    })
}

fn tempfile_in(store: &Store) -> Result<std::fs::File> {
    let dir = store.root().join("tmp");
    let path = dir.join(format!("push.{}.{}", std::process::id(), now_secs()));
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)
        .map_err(|e| Error::io("creating temp file", &path, e))?;
    // Unlinked at once: the open handle is all we need, and nothing leaks on a crash.
    let _ = std::fs::remove_file(&path);
    Ok(f)
}

/// Uploads a manifest under `tag` (used to publish hand-built images, e.g. in tests).
pub fn put_manifest(reference: &Reference, media_type: &str, bytes: &[u8]) -> Result<()> {
    put_manifest_with_client(
        &connect(reference, "pull,push")?,
        reference,
        media_type,
        bytes,
    )
}

/// `put_manifest` through a client the caller connected.
pub fn put_manifest_with_client(
    client: &Client,
    reference: &Reference,
    media_type: &str,
    bytes: &[u8],
) -> Result<()> {
    let murl = format!(
        "{}/manifests/{}",
        client.base(&reference.repo),
        reference.reference
    );
    let mut resp = client
        .put(&murl)
        .header("Content-Type", media_type)
        .send(bytes)
        .map_err(|e| reg_err(&murl, e))?;
    check_status(&murl, &mut resp, &[201])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references() {
        let r = Reference::parse("127.0.0.1:5000/lib/busybox:1.36").unwrap();
        assert_eq!(
            (r.registry.as_str(), r.repo.as_str(), r.reference.as_str()),
            ("127.0.0.1:5000", "lib/busybox", "1.36")
        );
        let r = Reference::parse("localhost/x").unwrap();
        assert_eq!(r.reference, "latest");
        let d = format!("sha256:{}", "a".repeat(64));
        let r = Reference::parse(&format!("reg.example:5000/x@{d}")).unwrap();
        assert_eq!(r.reference, d);
        assert_eq!(r.to_string(), format!("reg.example:5000/x@{d}"));
        assert!(Reference::parse("busybox").is_err());
        assert!(Reference::parse("localhost/UPPER").is_err());
    }
}
