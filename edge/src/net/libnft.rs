//! libnftables (Debian's `libnftables1`, what the `nft` program is built on) loaded at run
//! time: the same JSON transactions `nft -j -f -` takes, run in this process. A create then
//! costs no process start (~4 ms here, more under load), only the transaction itself.
//!
//! Loaded with dlopen rather than linked so that a node without the library still builds and
//! runs (through the `nft` program, see `nft.rs`). One context, used under a lock: a
//! context is not safe to share, and the kernel serializes nftables transactions anyway.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::{Mutex, OnceLock};

const LIBRARY: &CStr = c"libnftables.so.1";
/// `NFT_CTX_OUTPUT_JSON`: JSON listings, and input tried as JSON first.
const OUTPUT_JSON: u32 = 1 << 4;

type CtxNew = unsafe extern "C" fn(u32) -> *mut c_void;
type CtxSetFlags = unsafe extern "C" fn(*mut c_void, u32);
type CtxBuffer = unsafe extern "C" fn(*mut c_void) -> c_int;
type CtxGetBuffer = unsafe extern "C" fn(*mut c_void) -> *const c_char;
type RunFromBuffer = unsafe extern "C" fn(*mut c_void, *const c_char) -> c_int;

struct Context {
    ctx: *mut c_void,
    run: RunFromBuffer,
    output: CtxGetBuffer,
    error: CtxGetBuffer,
}

// SAFETY: the context is only touched through `Context::run`, under the mutex that holds it;
// libnftables keeps no thread-local state for a context.
unsafe impl Send for Context {}

static CONTEXT: OnceLock<Result<Mutex<Context>, String>> = OnceLock::new();

fn dl_error() -> String {
    // SAFETY: dlerror returns a thread-local message or NULL.
    let message = unsafe { libc::dlerror() };
    if message.is_null() {
        return "unknown dlopen error".into();
    }
    // SAFETY: a non-NULL dlerror result is a NUL-terminated string.
    unsafe { CStr::from_ptr(message) }
        .to_string_lossy()
        .into_owned()
}

/// The address of `name` in `lib`, as a function pointer of type `F`.
///
/// # Safety
/// `F` must be the symbol's C signature as an `unsafe extern "C" fn`.
unsafe fn symbol<F: Copy>(lib: *mut c_void, name: &CStr) -> Result<F, String> {
    // SAFETY: lib is a live handle from dlopen; name is NUL-terminated.
    let address = unsafe { libc::dlsym(lib, name.as_ptr()) };
    if address.is_null() {
        return Err(format!(
            "{} lacks {}: {}",
            LIBRARY.to_string_lossy(),
            name.to_string_lossy(),
            dl_error()
        ));
    }
    // SAFETY: pointer-sized function pointer of the signature the caller vouches for.
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&address) })
}

fn load() -> Result<Context, String> {
    // SAFETY: dlopen of a system library; the handle is never closed (the context lives as
    // long as the process).
    let lib = unsafe { libc::dlopen(LIBRARY.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if lib.is_null() {
        return Err(dl_error());
    }
    // SAFETY: the signatures are those of nftables/libnftables.h.
    let (new, set_flags, buffer_output, buffer_error, run, output, error) = unsafe {
        (
            symbol::<CtxNew>(lib, c"nft_ctx_new")?,
            symbol::<CtxSetFlags>(lib, c"nft_ctx_output_set_flags")?,
            symbol::<CtxBuffer>(lib, c"nft_ctx_buffer_output")?,
            symbol::<CtxBuffer>(lib, c"nft_ctx_buffer_error")?,
            symbol::<RunFromBuffer>(lib, c"nft_run_cmd_from_buffer")?,
            symbol::<CtxGetBuffer>(lib, c"nft_ctx_get_output_buffer")?,
            symbol::<CtxGetBuffer>(lib, c"nft_ctx_get_error_buffer")?,
        )
    };
    // SAFETY: NFT_CTX_DEFAULT (0); the calls below take the fresh context.
    let ctx = unsafe { new(0) };
    if ctx.is_null() {
        return Err("nft_ctx_new failed".into());
    }
    // SAFETY: ctx is the live context made above.
    unsafe {
        if buffer_output(ctx) != 0 || buffer_error(ctx) != 0 {
            return Err("cannot buffer libnftables' output".into());
        }
        set_flags(ctx, OUTPUT_JSON);
    }
    Ok(Context {
        ctx,
        run,
        output,
        error,
    })
}

/// Why the library could not be loaded (None: it is loaded).
pub(super) fn unavailable() -> Option<String> {
    CONTEXT
        .get_or_init(|| load().map(Mutex::new))
        .as_ref()
        .err()
        .cloned()
}

/// Runs `commands` (an nftables JSON document, or nft syntax) as one transaction; returns
/// what it printed (a listing). Err(message) when it failed; None when the library is
/// not there.
pub(super) fn run(commands: &str) -> Option<Result<String, String>> {
    let context = CONTEXT
        .get_or_init(|| load().map(Mutex::new))
        .as_ref()
        .ok()?;
    let Ok(input) = CString::new(commands) else {
        return Some(Err("the commands contain a NUL byte".into()));
    };
    let context = context.lock().unwrap_or_else(|e| e.into_inner());
    // SAFETY: a live context used only under this lock; the buffers returned are read
    // before the next call on the context (which reuses them).
    unsafe {
        let rc = (context.run)(context.ctx, input.as_ptr());
        let text = |buffer: *const c_char| {
            if buffer.is_null() {
                String::new()
            } else {
                CStr::from_ptr(buffer).to_string_lossy().into_owned()
            }
        };
        let output = text((context.output)(context.ctx));
        let error = text((context.error)(context.ctx));
        Some(if rc == 0 { Ok(output) } else { Err(error) })
    }
}
