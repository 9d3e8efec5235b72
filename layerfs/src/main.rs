//! `dsec-layerfs`: manage the layer store and mount images. The `dsec image ...` CLI can
//! wrap the same library calls.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use serde_json::json;

use dsec_layerfs::build::{build_from_dir, DirMode};
use dsec_layerfs::cache::NodeCache;
use dsec_layerfs::index::Kind;
use dsec_layerfs::oci::{self, Reference};
use dsec_layerfs::sandbox::SandboxRoot;
use dsec_layerfs::store::{now_secs, ImageRecord, Store, StoreConfig};
use dsec_layerfs::{fuse, overlay, prefetch, tarfmt, Digest, Error, Result};

#[derive(Parser)]
#[command(
    name = "dsec-layerfs",
    about = "Content-addressed image layers, lazily loaded",
    version
)]
struct Cli {
    /// Shared chunk store (a local dir or an NFS/CephFS/JuiceFS mount) [env
    /// DSEC_LAYERFS_STORE, default /var/lib/dsec/layerfs/store].
    #[arg(long, global = true)]
    store: Option<PathBuf>,
    /// Per-node chunk cache [env DSEC_LAYERFS_CACHE, default /var/lib/dsec/layerfs/cache].
    #[arg(long, global = true)]
    cache: Option<PathBuf>,
    /// Node cache size cap in MiB.
    #[arg(long, default_value_t = 10240, global = true)]
    cache_mib: u64,
    /// Chunk size for new layers, in KiB.
    #[arg(long, default_value_t = 1024, global = true)]
    chunk_kib: u32,
    /// Store new chunks uncompressed.
    #[arg(long, global = true)]
    no_zstd: bool,
    /// Machine-readable output.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Import an image: a registry reference (host[:port]/repo[:tag]), or layer tars
    /// (gzip/zstd/plain, bottom first), or a directory.
    Import {
        source: Vec<String>,
        /// Image name (default: the reference).
        #[arg(long)]
        name: Option<String>,
        /// Treat SOURCE as a directory tree (one layer).
        #[arg(long)]
        dir: bool,
    },
    /// List images.
    Ls,
    /// Show an image's layers and sizes.
    Inspect { name: String },
    /// Remove an image record (its data goes at the next gc).
    Rm { name: String },
    /// Delete layers, chunks and blobs no image references (older than the grace period).
    Gc {
        #[arg(long, default_value_t = 3600)]
        grace_secs: u64,
    },
    /// Mount an image read-only (or with --writable DIR as a sandbox root in DIR/root) and
    /// serve until SIGINT/SIGTERM.
    Mount {
        name: String,
        mountpoint: Option<PathBuf>,
        #[arg(long)]
        writable: Option<PathBuf>,
        /// Record the access order and store it as the image's hot list on exit.
        #[arg(long)]
        record_hot: bool,
        /// Prefetch the image's hot list in the background.
        #[arg(long)]
        prefetch: bool,
    },
    /// Pack a sandbox's overlayfs upper dir into a new layer on top of BASE as image NAME.
    Pack {
        upper: PathBuf,
        #[arg(long)]
        base: String,
        #[arg(long)]
        name: String,
    },
    /// Push an image to a registry as an OCI image.
    Push { name: String, reference: String },
    /// Write one layer as a tar (to stdout with "-").
    ExportLayer { layer: String, out: PathBuf },
    /// Serve mounts for the whole node over a Unix socket (JSON lines; see the serve module)
    /// until SIGINT/SIGTERM, then unmount everything.
    Serve {
        #[arg(long, default_value = "/run/dsec/layerfs.sock")]
        socket: PathBuf,
    },
    /// Build an ext4 image of an image's merged tree (block/pmem device for microVMs).
    BuildExt4 { name: String, out: PathBuf },
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("DSEC_LOG")
                .unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            if cli.json {
                println!("{}", json!({"error": e.to_string()}));
            } else {
                eprintln!("dsec-layerfs: {e}");
            }
            ExitCode::FAILURE
        }
    }
}

fn dir_arg(arg: &Option<PathBuf>, env: &str, default: &str) -> PathBuf {
    arg.clone()
        .or_else(|| std::env::var_os(env).map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from(default))
}

fn cache_dir(cli: &Cli) -> PathBuf {
    dir_arg(
        &cli.cache,
        "DSEC_LAYERFS_CACHE",
        "/var/lib/dsec/layerfs/cache",
    )
}

fn open_store(cli: &Cli) -> Result<Arc<Store>> {
    Ok(Arc::new(Store::open(
        dir_arg(
            &cli.store,
            "DSEC_LAYERFS_STORE",
            "/var/lib/dsec/layerfs/store",
        ),
        StoreConfig {
            chunk_size: cli.chunk_kib.saturating_mul(1024),
            zstd_level: (!cli.no_zstd).then_some(3),
            fsync: false,
        },
    )?))
}

fn human(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    format!("{v:.1} {}", units[u])
}

fn run(cli: &Cli) -> Result<()> {
    let store = open_store(cli)?;
    match &cli.cmd {
        Cmd::Import { source, name, dir } => {
            let first = source.first().ok_or_else(|| {
                Error::Invalid("import needs a source: a reference, tar files or --dir DIR".into())
            })?;
            if *dir {
                let (id, idx, stats) = build_from_dir(&store, first.as_ref(), DirMode::Plain)?;
                let name = name
                    .clone()
                    .unwrap_or_else(|| format!("dir-{}", id.short()));
                store.put_image(&ImageRecord {
                    name: name.clone(),
                    layers: vec![id],
                    diff_ids: vec![],
                    config: None,
                    hot_list: None,
                    created: now_secs(),
                })?;
                return report(
                    cli,
                    json!({"name": name, "layer": id, "entries": idx.entries.len(), "stats": stats}),
                    || {
                        format!(
                            "{name}: layer {} ({} entries, {})",
                            id.short(),
                            idx.entries.len(),
                            human(stats.file_bytes)
                        )
                    },
                );
            }
            let is_file = std::path::Path::new(first).exists() || first == "-";
            if !is_file {
                let r = Reference::parse(first)?;
                let name = name.clone().unwrap_or_else(|| r.to_string());
                eprintln!("pulling {r} ...");
                let rep = oci::pull(&store, &r, &name)?;
                return report(cli, serde_json::to_value(&rep).expect("serializes"), || {
                    format!(
                        "{name}: {} layers, {} downloaded, {} of files, {} new chunks",
                        rep.image.layers.len(),
                        human(rep.compressed_bytes),
                        human(rep.file_bytes),
                        rep.new_chunks
                    )
                });
            }
            let name = name
                .clone()
                .ok_or_else(|| Error::Invalid("importing tar files needs --name".into()))?;
            let mut layers = Vec::new();
            let mut diff_ids = Vec::new();
            for (i, src) in source.iter().enumerate() {
                eprintln!("[{}/{}] importing {src} ...", i + 1, source.len());
                let imp = if src == "-" {
                    tarfmt::import_tar(&store, std::io::stdin().lock())?
                } else {
                    let f = std::fs::File::open(src).map_err(|e| Error::io("opening", src, e))?;
                    tarfmt::import_tar(&store, std::io::BufReader::new(f))?
                };
                layers.push(imp.layer);
                diff_ids.push(imp.diff_id);
            }
            let rec = ImageRecord {
                name: name.clone(),
                layers,
                diff_ids,
                config: None,
                hot_list: None,
                created: now_secs(),
            };
            store.put_image(&rec)?;
            report(cli, serde_json::to_value(&rec).expect("serializes"), || {
                format!("{name}: {} layers", rec.layers.len())
            })
        }
        Cmd::Ls => {
            let imgs = store.list_images()?;
            report(
                cli,
                serde_json::to_value(&imgs).expect("serializes"),
                || {
                    let mut s = format!(
                        "{:<40} {:>6} {:>12}  TOP LAYER",
                        "NAME", "LAYERS", "CREATED"
                    );
                    for i in &imgs {
                        s.push_str(&format!(
                            "\n{:<40} {:>6} {:>12}  {}",
                            i.name,
                            i.layers.len(),
                            i.created,
                            i.layers.last().map(|l| l.short()).unwrap_or_default()
                        ));
                    }
                    s
                },
            )
        }
        Cmd::Inspect { name } => {
            let img = store.get_image(name)?;
            let mut layers = Vec::new();
            for id in &img.layers {
                let idx = store.get_layer(id)?;
                let whiteouts = idx
                    .entries
                    .iter()
                    .filter(|e| e.kind == Kind::Whiteout)
                    .count();
                layers.push(json!({
                    "id": id, "entries": idx.entries.len(), "file_bytes": idx.total_file_bytes(),
                    "whiteouts": whiteouts, "chunk_size": idx.chunk_size,
                }));
            }
            let v = json!({"image": img, "layers": layers});
            report(cli, v.clone(), || {
                let mut s = format!("image {name}");
                for l in &layers {
                    s.push_str(&format!(
                        "\n  layer {}  {} entries  {}  {} whiteouts",
                        l["id"].as_str().unwrap_or(""),
                        l["entries"],
                        human(l["file_bytes"].as_u64().unwrap_or(0)),
                        l["whiteouts"]
                    ));
                }
                s
            })
        }
        Cmd::Rm { name } => {
            store.remove_image(name)?;
            report(cli, json!({"removed": name}), || format!("removed {name}"))
        }
        Cmd::Gc { grace_secs } => {
            let r = store.gc(std::time::Duration::from_secs(*grace_secs))?;
            report(cli, serde_json::to_value(&r).expect("serializes"), || {
                format!(
                    "removed {} layers, {} chunks ({}), {} blobs",
                    r.layers_removed,
                    r.chunks_removed,
                    human(r.bytes_freed),
                    r.blobs_removed
                )
            })
        }
        Cmd::Mount {
            name,
            mountpoint,
            writable,
            record_hot,
            prefetch: want_prefetch,
        } => {
            let img = store.get_image(name)?;
            let cache = Arc::new(NodeCache::open(
                cache_dir(cli),
                store.clone(),
                cli.cache_mib << 20,
            )?);
            let mask = block_signals();
            let (sandbox, plain) = match (writable, mountpoint) {
                (Some(dir), _) => (
                    Some(SandboxRoot::mount(
                        cache.clone(),
                        &img.layers,
                        dir,
                        *record_hot,
                    )?),
                    None,
                ),
                (None, Some(mp)) => {
                    let tree = Arc::new(cache.compose(&img.layers)?);
                    (
                        None,
                        Some(fuse::mount(tree, cache.clone(), mp, *record_hot)?),
                    )
                }
                (None, None) => {
                    return Err(Error::Invalid(
                        "mount needs a MOUNTPOINT or --writable DIR".into(),
                    ))
                }
            };
            let m = sandbox
                .as_ref()
                .and_then(|s| s.fuse())
                .or(plain.as_ref())
                .expect("one is mounted");
            if *want_prefetch {
                if let Some(list) = prefetch::load(&store, name)? {
                    prefetch::start(cache.clone(), m.tree.clone(), list, cli.cache_mib << 19);
                }
            }
            let at = sandbox
                .as_ref()
                .map(|s| s.root())
                .or(mountpoint.clone())
                .unwrap_or_default();
            if cli.json {
                println!("{}", json!({"mounted": at, "image": name}));
            } else {
                println!(
                    "{name} mounted at {}; SIGINT/SIGTERM to unmount",
                    at.display()
                );
            }
            wait_signal(&mask);
            let hot = record_hot.then(|| prefetch::HotList::from_mount(m));
            if let Some(s) = sandbox {
                s.unmount()?;
            }
            if let Some(p) = plain {
                p.unmount();
            }
            if let Some(h) = hot {
                let d = prefetch::save(&store, name, h)?;
                eprintln!("hot list saved as {}", d.short());
            }
            cache.persist()
        }
        Cmd::Pack { upper, base, name } => {
            let b = store.get_image(base)?;
            let (id, idx, stats) = overlay::pack_diff(&store, upper)?;
            let mut layers = b.layers.clone();
            layers.push(id);
            let rec = ImageRecord {
                name: name.clone(),
                layers,
                diff_ids: vec![],
                config: b.config,
                hot_list: None,
                created: now_secs(),
            };
            store.put_image(&rec)?;
            report(
                cli,
                json!({"image": rec, "layer": id, "entries": idx.entries.len(), "stats": stats}),
                || {
                    format!(
                        "{name}: {} + layer {} ({} entries, {} new chunks)",
                        base,
                        id.short(),
                        idx.entries.len(),
                        stats.new_chunks
                    )
                },
            )
        }
        Cmd::Push { name, reference } => {
            let r = Reference::parse(reference)?;
            let rep = oci::push(&store, name, &r)?;
            report(cli, serde_json::to_value(&rep).expect("serializes"), || {
                format!(
                    "pushed {name} to {} ({})",
                    rep.reference, rep.manifest_digest
                )
            })
        }
        Cmd::Serve { socket } => {
            let cache = Arc::new(NodeCache::open(
                cache_dir(cli),
                store.clone(),
                cli.cache_mib << 20,
            )?);
            let mask = block_signals();
            if let Some(dir) = socket.parent() {
                std::fs::create_dir_all(dir)
                    .map_err(|e| Error::io("creating socket directory", dir, e))?;
            }
            let svc = dsec_layerfs::serve::Service::new(store.clone(), cache);
            dsec_layerfs::serve::listen(svc.clone(), socket)?;
            eprintln!("serving on {}", socket.display());
            wait_signal(&mask);
            svc.shutdown();
            let _ = std::fs::remove_file(socket);
            Ok(())
        }
        Cmd::BuildExt4 { name, out } => {
            let img = store.get_image(name)?;
            let cache = NodeCache::open(cache_dir(cli), store.clone(), cli.cache_mib << 20)?;
            let tree = cache.compose(&img.layers)?;
            let work = out
                .parent()
                .map(|p| p.to_path_buf())
                .unwrap_or_else(|| PathBuf::from("."))
                .join(format!(".layerfs-ext4-{}", std::process::id()));
            let size = dsec_layerfs::image::build_ext4(&cache, &tree, out, &work)?;
            report(
                cli,
                json!({"image": name, "out": out, "bytes": size}),
                || format!("{name}: {} ({})", out.display(), human(size)),
            )
        }
        Cmd::ExportLayer { layer, out } => {
            let id = Digest::parse(layer)?;
            let idx = store.get_layer(&id)?;
            if out.as_os_str() == "-" {
                tarfmt::export_tar(&store, &idx, std::io::stdout().lock())
            } else {
                let f = std::fs::File::create(out).map_err(|e| Error::io("creating", out, e))?;
                tarfmt::export_tar(&store, &idx, std::io::BufWriter::new(f))
            }
        }
    }
}

fn report(cli: &Cli, v: serde_json::Value, text: impl FnOnce() -> String) -> Result<()> {
    if cli.json {
        println!("{v}");
    } else {
        println!("{}", text());
    }
    Ok(())
}

/// Blocks SIGINT/SIGTERM in this thread (and the threads it starts) so `wait_signal` can
/// take them synchronously.
fn block_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data; sigemptyset initializes it before use.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: set is a valid sigset_t; the signal numbers are valid.
    unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
    set
}

fn wait_signal(set: &libc::sigset_t) {
    let mut sig = 0;
    // SAFETY: set is an initialized sigset_t and sig a valid out pointer.
    unsafe { libc::sigwait(set, &mut sig) };
}
