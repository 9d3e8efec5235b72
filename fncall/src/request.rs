//! A call and its result, independent of how they arrive (gRPC, SandboxFusion HTTP, SDKs).

use std::collections::BTreeMap;
use std::path::{Component, Path};
use std::time::Duration;

use crate::error::{FnCallError, Result};

/// The languages a worker can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Language {
    Python,
    Bash,
    Cpp,
    Node,
}

impl Language {
    pub const ALL: [Language; 4] = [Self::Python, Self::Bash, Self::Cpp, Self::Node];

    /// Accepts the names SandboxFusion uses too (`python`, `bash`, `cpp`, `nodejs`).
    pub fn parse(name: &str) -> Result<Self> {
        match name.to_ascii_lowercase().as_str() {
            "python" | "python3" | "py" => Ok(Self::Python),
            "bash" | "sh" => Ok(Self::Bash),
            "cpp" | "c++" | "cxx" => Ok(Self::Cpp),
            "node" | "nodejs" | "javascript" | "js" => Ok(Self::Node),
            _ => Err(FnCallError::UnknownLanguage(name.to_string())),
        }
    }

    /// The language of a source file, from its extension.
    pub fn from_path(path: &Path) -> Result<Self> {
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        match ext {
            "py" => Ok(Self::Python),
            "sh" | "bash" => Ok(Self::Bash),
            "cpp" | "cc" | "cxx" | "C" => Ok(Self::Cpp),
            "js" | "mjs" | "cjs" => Ok(Self::Node),
            _ => Err(FnCallError::UnknownLanguage(format!(
                "{} (extension {ext:?}; use .py, .sh, .cpp or .js, or name the language)",
                path.display()
            ))),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Python => "python",
            Self::Bash => "bash",
            Self::Cpp => "cpp",
            Self::Node => "node",
        }
    }

    /// The file the code is written to in the call's working directory.
    pub fn main_file(self) -> &'static str {
        match self {
            Self::Python => "main.py",
            Self::Bash => "main.sh",
            Self::Cpp => "main.cpp",
            Self::Node => "main.js",
        }
    }

    pub fn compiles(self) -> bool {
        self == Self::Cpp
    }
}

/// Upper bounds on what a caller may ask for.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(300);
pub const MAX_MEMORY_MIB: u32 = 16 * 1024;
/// Code + stdin + files of one call.
pub const MAX_INPUT_BYTES: usize = 32 << 20;
/// Modules that send a python call to the full zygote (numpy preloaded): numpy and what is
/// built on it.
const HEAVY_MODULES: [&str; 8] = [
    "numpy",
    "pandas",
    "scipy",
    "sklearn",
    "matplotlib",
    "torch",
    "tensorflow",
    "jax",
];
pub const MAX_FILES: usize = 256;

/// One call.
#[derive(Clone, Debug)]
pub struct CallRequest {
    pub language: Language,
    pub code: String,
    pub stdin: Vec<u8>,
    /// Written under the working directory before the code runs (relative names).
    pub files: BTreeMap<String, Vec<u8>>,
    /// Read back from the working directory after the run (relative names).
    pub fetch_files: Vec<String>,
    pub compile_timeout: Duration,
    pub run_timeout: Duration,
    pub memory_mib: u32,
    /// Network access: None, loopback only. Some: the call runs in a worker on the node's
    /// sandbox network with these rules (refused, `NoCallNetwork`, where there is none).
    pub network: Option<crate::network::NetworkRules>,
}

impl CallRequest {
    pub fn new(language: Language, code: impl Into<String>) -> Self {
        Self {
            language,
            code: code.into(),
            stdin: Vec::new(),
            files: BTreeMap::new(),
            fetch_files: Vec::new(),
            compile_timeout: Duration::from_secs(10),
            run_timeout: Duration::from_secs(10),
            memory_mib: 512,
            network: None,
        }
    }

    /// Whether the code (or a python file handed in) names a module the full python zygote
    /// preloads, or one built on it: such calls go to the full zygote, the others to a lean
    /// one. A plain text match: a false hit only costs the lean zygote's speed, and a module
    /// imported without its name in the text still works (imported in the call).
    pub fn names_heavy_modules(&self) -> bool {
        let names = |text: &[u8]| {
            HEAVY_MODULES
                .iter()
                .any(|m| text.windows(m.len()).any(|w| w == m.as_bytes()))
        };
        names(self.code.as_bytes())
            || self
                .files
                .iter()
                .any(|(name, data)| name.ends_with(".py") && names(data))
    }

    /// Rejects what no worker should be handed: bounds, and file names that would leave the
    /// working directory.
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(FnCallError::InvalidRequest(msg));
        for (what, t) in [
            ("compile_timeout", self.compile_timeout),
            ("run_timeout", self.run_timeout),
        ] {
            if t.is_zero() || t > MAX_TIMEOUT {
                return bad(format!(
                    "{what} {t:?} is out of range (more than 0, at most {MAX_TIMEOUT:?})"
                ));
            }
        }
        if self.memory_mib < 16 || self.memory_mib > MAX_MEMORY_MIB {
            return bad(format!(
                "memory limit {} MiB is out of range (16 to {MAX_MEMORY_MIB} MiB)",
                self.memory_mib
            ));
        }
        if self.files.len() > MAX_FILES || self.fetch_files.len() > MAX_FILES {
            return bad(format!(
                "at most {MAX_FILES} files in and {MAX_FILES} to fetch"
            ));
        }
        let input = self.code.len()
            + self.stdin.len()
            + self
                .files
                .iter()
                .map(|(k, v)| k.len() + v.len())
                .sum::<usize>();
        if input > MAX_INPUT_BYTES {
            return bad(format!(
                "code, stdin and files are {input} bytes, more than the {MAX_INPUT_BYTES} allowed"
            ));
        }
        for name in self.files.keys().chain(&self.fetch_files) {
            check_file_name(name)?;
        }
        if self.files.contains_key(self.language.main_file()) {
            return bad(format!(
                "file {:?} is where the code goes; give it another name",
                self.language.main_file()
            ));
        }
        Ok(())
    }
}

/// A relative path of plain components, inside the working directory.
pub fn check_file_name(name: &str) -> Result<()> {
    let path = Path::new(name);
    let plain = !name.is_empty()
        && name.len() <= 255
        && !name.contains('\0')
        && path.components().all(|c| matches!(c, Component::Normal(_)));
    if plain {
        Ok(())
    } else {
        Err(FnCallError::InvalidRequest(format!(
            "file name {name:?} must be a relative path inside the working directory (no '..', no leading '/')"
        )))
    }
}

/// How a stage ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StageStatus {
    /// Ran to its end (whatever its exit code).
    Finished,
    /// Killed at its wall or CPU time limit.
    TimeLimitExceeded,
    /// Could not be started.
    Error,
}

impl StageStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Finished => "Finished",
            Self::TimeLimitExceeded => "TimeLimitExceeded",
            Self::Error => "Error",
        }
    }
}

/// One stage (compile or run) of a call.
#[derive(Clone, Debug)]
pub struct StageResult {
    pub status: StageStatus,
    pub exit_code: Option<i32>,
    /// The signal that killed it, if one did.
    pub signal: Option<i32>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    pub duration: Duration,
}

impl StageResult {
    /// An exit code as a shell reports it: 128+N for a signal.
    pub fn return_code(&self) -> Option<i32> {
        self.exit_code.or(self.signal.map(|s| 128 + s))
    }

    pub fn succeeded(&self) -> bool {
        self.status == StageStatus::Finished && self.exit_code == Some(0)
    }
}

/// What a call produced.
#[derive(Clone, Debug, Default)]
pub struct CallResult {
    pub compile: Option<StageResult>,
    pub run: Option<StageResult>,
    pub files: BTreeMap<String, Vec<u8>>,
    /// Files asked for that could not be fetched, with why.
    pub file_errors: Vec<String>,
    /// The call went over its memory limit (the cgroup killed a process).
    pub out_of_memory: bool,
    /// Engine-side time, queueing included.
    pub total: Duration,
}

impl CallResult {
    /// Every stage ran to its end with exit code 0 (and the run stage happened).
    pub fn success(&self) -> bool {
        self.run.is_some()
            && [&self.compile, &self.run]
                .into_iter()
                .flatten()
                .all(|s| s.succeeded())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heavy_modules_are_found_in_the_code_and_python_files() {
        let mut call = CallRequest::new(Language::Python, "print(1+1)");
        assert!(!call.names_heavy_modules());
        call.files.insert("data.txt".into(), b"numpy".to_vec());
        assert!(!call.names_heavy_modules(), "only python files count");
        call.files
            .insert("helper.py".into(), b"import pandas".to_vec());
        assert!(call.names_heavy_modules());
        for code in [
            "import numpy as np",
            "from scipy import stats",
            "x = 1  # numpy",
        ] {
            assert!(CallRequest::new(Language::Python, code).names_heavy_modules());
        }
    }

    #[test]
    fn file_names_stay_inside_the_work_dir() {
        for ok in ["a.txt", "dir/b.bin"] {
            assert!(check_file_name(ok).is_ok(), "{ok}");
        }
        for bad in ["", "/etc/passwd", "../x", "a/../../x", "./a", "a\0b"] {
            assert!(check_file_name(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn languages_from_names_and_extensions() {
        assert_eq!(Language::parse("nodejs").unwrap(), Language::Node);
        assert!(matches!(
            Language::parse("cobol"),
            Err(FnCallError::UnknownLanguage(_))
        ));
        assert_eq!(
            Language::from_path(Path::new("x/a.cpp")).unwrap(),
            Language::Cpp
        );
        assert!(Language::from_path(Path::new("a.rb")).is_err());
    }
}
