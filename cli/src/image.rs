//! `dsec image ...`: the layer store (`dsec-layerfs`) from the main CLI. Import images from
//! a plain-HTTP registry, layer tars or a directory, list, inspect and remove them, pack a
//! stopped sandbox's overlayfs upper dir into a new image, and collect garbage. Same store
//! and cache locations (flags, env vars, defaults) as the `dsec-layerfs` binary, through
//! the same library calls.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use dsec_layerfs::manage::{self, ImageTable, ImportSource};
use dsec_layerfs::progress::{NoProgress, Progress};
use dsec_layerfs::store::{Store, StoreConfig};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;

#[derive(clap::Args, Debug)]
pub struct ImageArgs {
    /// Shared chunk store [env DSEC_LAYERFS_STORE; default $DSEC_HOME/layerfs/store,
    /// DSEC_HOME=/var/lib/dsec]. Only import creates it.
    #[arg(long, global = true, value_name = "DIR")]
    store: Option<PathBuf>,
    /// This node's chunk cache; `inspect` counts the chunks cached here [env
    /// DSEC_LAYERFS_CACHE; default $DSEC_HOME/layerfs/cache].
    #[arg(long, global = true, value_name = "DIR")]
    cache: Option<PathBuf>,
    #[command(subcommand)]
    command: ImageCommand,
}

#[derive(clap::Subcommand, Debug)]
pub enum ImageCommand {
    /// Import an image: a registry reference (host[:port]/repo[:tag], plain HTTP), layer
    /// tars (gzip/zstd/plain, bottom first, `-` for stdin), or a directory tree (--dir).
    Import {
        /// A registry reference, or layer tar files.
        #[arg(
            value_name = "REF|TAR",
            required_unless_present = "dir",
            conflicts_with = "dir"
        )]
        sources: Vec<String>,
        /// Import this directory tree as a one-layer image.
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
        /// Image name (default: the reference; `dir-<layer>` for a directory; required
        /// for tars). An image of the same name is replaced.
        #[arg(long)]
        name: Option<String>,
    },
    /// List the images in the store.
    Ls,
    /// Show an image's layers: ids, entries, file and stored sizes, chunks.
    Inspect { name: String },
    /// Remove an image record; its layers and chunks go at the next gc unless another
    /// image uses them.
    Rm { name: String },
    /// Pack a stopped sandbox's overlayfs upper dir into a new layer on top of BASE,
    /// recorded as image NAME.
    Pack {
        #[arg(value_name = "UPPER_DIR")]
        upper: PathBuf,
        /// The image the sandbox ran on.
        #[arg(long)]
        base: String,
        /// Name of the new image.
        #[arg(long)]
        name: String,
    },
    /// Delete layers, chunks and blobs no image references, when older than the grace
    /// period (an import in progress writes chunks before its image record).
    Gc {
        #[arg(long, value_name = "N", default_value_t = 3600)]
        grace_secs: u64,
    },
}

/// Runs one `dsec image` command. With `json`, stdout gets exactly one JSON document: the
/// result, or `{"error": "..."}` (the error is also returned for stderr and the exit code).
pub fn run(args: ImageArgs, json: bool) -> Result<i32, dsec_layerfs::Error> {
    match execute(&args) {
        Ok(output) => {
            if json {
                println!("{}", output.json);
            } else {
                println!("{}", output.text);
            }
            Ok(0)
        }
        Err(err) => {
            if json {
                println!("{}", serde_json::json!({ "error": err.to_string() }));
            }
            Err(err)
        }
    }
}

/// A command's result in both forms.
struct Output {
    json: String,
    text: String,
}

impl Output {
    fn new(value: &impl Serialize, text: String) -> Self {
        Output {
            json: serde_json::to_string(value).expect("reports serialize"),
            text,
        }
    }
}

fn execute(args: &ImageArgs) -> Result<Output, dsec_layerfs::Error> {
    let store_dir = manage::store_dir(args.store.as_deref());
    let config = StoreConfig::default();
    match &args.command {
        ImageCommand::Import { sources, dir, name } => {
            // Every source and the name are checked before the store is touched.
            let source = match dir {
                Some(dir) => ImportSource::from_dir(dir.clone())?,
                None => ImportSource::from_args(sources, false)?,
            };
            if let Some(name) = name {
                Store::check_image_name(name)?;
            }
            let store = Store::open(store_dir, config)?;
            store.check_writable()?;
            let bars = Bars::for_stderr();
            let report = manage::import(&store, &source, name.as_deref(), bars.progress())?;
            drop(bars);
            let text = report.to_string();
            Ok(Output::new(&report, text))
        }
        ImageCommand::Ls => {
            let store = Store::open_existing(store_dir, config)?;
            let images = store.list_images()?;
            let mut text = ImageTable(&images).to_string();
            text.push_str(&directory_images());
            Ok(Output::new(&images, text))
        }
        ImageCommand::Inspect { name } => {
            let store = Store::open_existing(store_dir, config)?;
            let cache = manage::cache_dir(args.cache.as_deref());
            let details = manage::inspect(&store, name, Some(&cache))?;
            let text = details.to_string();
            Ok(Output::new(&details, text))
        }
        ImageCommand::Rm { name } => {
            let store = Store::open_existing(store_dir, config)?;
            store.check_writable()?;
            store.remove_image(name)?;
            Ok(Output::new(
                &serde_json::json!({ "removed": name }),
                format!("removed {name}; its data goes at the next `dsec image gc`"),
            ))
        }
        ImageCommand::Pack { upper, base, name } => {
            let store = Store::open_existing(store_dir, config)?;
            store.check_writable()?;
            let bars = Bars::for_stderr();
            let report = manage::pack(&store, upper, base, name, bars.progress())?;
            drop(bars);
            let text = report.to_string();
            Ok(Output::new(&report, text))
        }
        ImageCommand::Gc { grace_secs } => {
            let store = Store::open_existing(store_dir, config)?;
            store.check_writable()?;
            let report = store.gc(Duration::from_secs(*grace_secs))?;
            let text = report.to_string();
            Ok(Output::new(&report, text))
        }
    }
}

/// Progress bars on stderr when it is a terminal; nothing at all otherwise.
enum Bars {
    Drawn(BarProgress),
    Hidden,
}

impl Bars {
    fn for_stderr() -> Bars {
        if std::io::stderr().is_terminal() {
            Bars::Drawn(BarProgress::new())
        } else {
            Bars::Hidden
        }
    }

    fn progress(&self) -> &dyn Progress {
        match self {
            Bars::Drawn(bar) => bar,
            Bars::Hidden => &NoProgress,
        }
    }
}

/// One bar per layer, reused: bytes of the source against its size when the size is known
/// (tar files, registry blobs), else a spinner over bytes of file content; the message
/// counts chunks.
struct BarProgress {
    bar: ProgressBar,
    chunks: AtomicU64,
    new_chunks: AtomicU64,
}

impl BarProgress {
    fn new() -> Self {
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
        bar.set_style(Self::style("{spinner} {msg}"));
        bar.set_message("checking the source");
        // Keeps the spinner moving while one large file is hashed and compressed.
        bar.enable_steady_tick(Duration::from_millis(120));
        BarProgress {
            bar,
            chunks: AtomicU64::new(0),
            new_chunks: AtomicU64::new(0),
        }
    }

    fn style(template: &str) -> ProgressStyle {
        ProgressStyle::with_template(template)
            .expect("progress templates are constant and valid")
            .progress_chars("=> ")
    }
}

impl Progress for BarProgress {
    fn layer_started(&self, index: usize, count: usize, source_bytes: Option<u64>) {
        self.bar.set_prefix(format!("layer {}/{count}", index + 1));
        self.bar.set_position(0);
        self.chunks.store(0, Ordering::Relaxed);
        self.new_chunks.store(0, Ordering::Relaxed);
        self.bar.set_message("");
        match source_bytes {
            Some(total) => {
                self.bar.set_length(total);
                self.bar.set_style(Self::style(
                    "{prefix} [{bar:30}] {binary_bytes}/{binary_total_bytes} \
                     {binary_bytes_per_sec} {msg}",
                ));
            }
            None => {
                self.bar.unset_length();
                self.bar.set_style(Self::style(
                    "{prefix} {spinner} {binary_bytes} of files {msg}",
                ));
            }
        }
    }

    fn layer_finished(&self, reused: bool) {
        if reused {
            self.bar.set_message("already in the store");
        }
        self.bar.tick();
    }

    fn source_read(&self, bytes: u64) {
        if self.bar.length().is_some() {
            self.bar.inc(bytes);
        }
    }

    fn chunk_stored(&self, len: u64, new: bool) {
        let chunks = self.chunks.fetch_add(1, Ordering::Relaxed) + 1;
        let new_chunks =
            self.new_chunks.fetch_add(u64::from(new), Ordering::Relaxed) + u64::from(new);
        if self.bar.length().is_none() {
            self.bar.inc(len);
        }
        self.bar
            .set_message(format!("{chunks} chunks ({new_chunks} new)"));
    }
}

impl Drop for BarProgress {
    fn drop(&mut self) {
        self.bar.finish_and_clear();
    }
}

/// The directory images beside the store (`$DSEC_HOME/images/NAME/rootfs`: busybox, debian,
/// fncall), for the text listing.
fn directory_images() -> String {
    let dir = dsec_edge::paths::Artifacts::home().join("images");
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().join("rootfs").is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    if names.is_empty() {
        return String::new();
    }
    names.sort();
    let mut text = format!("\ndirectory images ({}):\n", dir.display());
    for name in names {
        let manifest = dir.join(&name).join("manifest");
        let packages = std::fs::read_to_string(&manifest)
            .map(|m| format!("{} packages", m.lines().count()))
            .unwrap_or_else(|_| "no package manifest".into());
        text.push_str(&format!("  {name:<12} {packages}\n"));
    }
    text
}
