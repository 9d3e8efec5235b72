//! `dsec-layerfs`: manage the layer store and mount images. `dsec image ...` wraps the same
//! library calls (the `manage` module) for import, ls, inspect, rm, pack and gc.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand};
use serde_json::json;

use dsec_layerfs::cache::NodeCache;
use dsec_layerfs::manage::{self, human_bytes, ImageTable, ImportSource};
use dsec_layerfs::oci::{self, Reference};
use dsec_layerfs::progress::{NoProgress, Progress};
use dsec_layerfs::sandbox::SandboxRoot;
use dsec_layerfs::store::{Store, StoreConfig};
use dsec_layerfs::{fuse, prefetch, tarfmt, Digest, Error, Result};

#[derive(Parser)]
#[command(
    name = "dsec-layerfs",
    about = "Content-addressed image layers, lazily loaded",
    version
)]
struct Cli {
    /// Shared chunk store (a local dir or an NFS/CephFS/JuiceFS mount) [env
    /// DSEC_LAYERFS_STORE, default $DSEC_HOME/layerfs/store, DSEC_HOME=/var/lib/dsec].
    #[arg(long, global = true)]
    store: Option<PathBuf>,
    /// Per-node chunk cache [env DSEC_LAYERFS_CACHE, default $DSEC_HOME/layerfs/cache].
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

fn cache_dir(cli: &Cli) -> PathBuf {
    manage::cache_dir(cli.cache.as_deref())
}

fn store_config(cli: &Cli) -> StoreConfig {
    StoreConfig {
        chunk_size: cli.chunk_kib.saturating_mul(1024),
        zstd_level: (!cli.no_zstd).then_some(3),
        fsync: false,
    }
}

fn open_store(cli: &Cli) -> Result<Arc<Store>> {
    Ok(Arc::new(Store::open(
        manage::store_dir(cli.store.as_deref()),
        store_config(cli),
    )?))
}

fn run(cli: &Cli) -> Result<()> {
    let store = open_store(cli)?;
    match &cli.cmd {
        Cmd::Import { source, name, dir } => {
            let source = ImportSource::from_args(source, *dir)?;
            store.check_writable()?;
            let rep = manage::import(&store, &source, name.as_deref(), &LayerLines)?;
            report(cli, serde_json::to_value(&rep).expect("serializes"), || {
                rep.to_string()
            })
        }
        Cmd::Ls => {
            let imgs = store.list_images()?;
            report(
                cli,
                serde_json::to_value(&imgs).expect("serializes"),
                || ImageTable(&imgs).to_string(),
            )
        }
        Cmd::Inspect { name } => {
            let details = manage::inspect(&store, name, Some(&cache_dir(cli)))?;
            report(
                cli,
                serde_json::to_value(&details).expect("serializes"),
                || details.to_string(),
            )
        }
        Cmd::Rm { name } => {
            store.remove_image(name)?;
            report(cli, json!({"removed": name}), || format!("removed {name}"))
        }
        Cmd::Gc { grace_secs } => {
            let r = store.gc(std::time::Duration::from_secs(*grace_secs))?;
            report(cli, serde_json::to_value(&r).expect("serializes"), || {
                r.to_string()
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
            store.check_writable()?;
            let rep = manage::pack(&store, upper, base, name, &NoProgress)?;
            report(cli, serde_json::to_value(&rep).expect("serializes"), || {
                rep.to_string()
            })
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
                || format!("{name}: {} ({})", out.display(), human_bytes(size)),
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

/// One stderr line per layer: this binary draws no progress bars (`dsec image` does).
struct LayerLines;

impl Progress for LayerLines {
    fn layer_started(&self, index: usize, count: usize, source_bytes: Option<u64>) {
        match source_bytes {
            Some(n) => eprintln!("[{}/{count}] importing {} ...", index + 1, human_bytes(n)),
            None => eprintln!("[{}/{count}] importing ...", index + 1),
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
