//! The WASI preview1 imports a `wasm32-wasip1` filter needs, the way Envoy provides them:
//! stdout/stderr go to the log, clocks read the virtual clock, and there is no filesystem.

use wasmtime::{Caller, Linker};

use super::memory::{read, write, write_u32, write_u64};
use super::vm::VmState;

type C<'a> = Caller<'a, VmState>;

const SUCCESS: u32 = 0;
const EBADF: u32 = 8;
const EFAULT: u32 = 21;
const EINVAL: u32 = 28;
pub(crate) const ENOSYS: u32 = 52;

const MODULE: &str = "wasi_snapshot_preview1";

macro_rules! wasi {
    ($linker:ident, $name:ident ( $($arg:ident : $ty:ty),* )) => {
        $linker.func_wrap(
            MODULE,
            stringify!($name),
            |mut caller: Caller<'_, VmState>, $($arg: $ty),*| -> wasmtime::Result<u32> {
                caller.data_mut().count(stringify!($name));
                $name(&mut caller, $($arg),*)
            },
        )?;
    };
}

pub(crate) fn add_to_linker(linker: &mut Linker<VmState>) -> wasmtime::Result<()> {
    wasi!(linker, fd_write(fd: u32, iovs: u32, iovs_len: u32, ret_written: u32));
    wasi!(linker, fd_read(fd: u32, iovs: u32, iovs_len: u32, ret_read: u32));
    wasi!(linker, fd_close(fd: u32));
    wasi!(linker, fd_seek(fd: u32, offset: i64, whence: u32, ret: u32));
    wasi!(linker, fd_fdstat_get(fd: u32, ret: u32));
    wasi!(linker, fd_fdstat_set_flags(fd: u32, flags: u32));
    wasi!(linker, fd_prestat_get(fd: u32, ret: u32));
    wasi!(linker, fd_prestat_dir_name(fd: u32, ptr: u32, len: u32));
    wasi!(linker, environ_get(environ: u32, buf: u32));
    wasi!(linker, environ_sizes_get(ret_count: u32, ret_size: u32));
    wasi!(linker, args_get(argv: u32, buf: u32));
    wasi!(linker, args_sizes_get(ret_count: u32, ret_size: u32));
    wasi!(linker, clock_res_get(id: u32, ret: u32));
    wasi!(linker, clock_time_get(id: u32, precision: u64, ret: u32));
    wasi!(linker, random_get(ptr: u32, len: u32));
    wasi!(linker, sched_yield());
    wasi!(linker, poll_oneoff(subscriptions: u32, events: u32, count: u32, ret: u32));
    linker.func_wrap(
        MODULE,
        "proc_exit",
        |mut caller: Caller<'_, VmState>, code: u32| -> wasmtime::Result<()> {
            caller.data_mut().count("proc_exit");
            Err(wasmtime::format_err!("the guest called proc_exit({code})"))
        },
    )?;
    Ok(())
}

fn errno<T>(result: Result<T, super::abi::Status>) -> u32 {
    match result {
        Ok(_) => SUCCESS,
        Err(_) => EFAULT,
    }
}

fn fd_write(
    c: &mut C<'_>,
    fd: u32,
    iovs: u32,
    iovs_len: u32,
    ret_written: u32,
) -> wasmtime::Result<u32> {
    if fd != 1 && fd != 2 {
        return Ok(EBADF);
    }
    let mut text = Vec::new();
    for i in 0..iovs_len {
        let Some(at) = i.checked_mul(8).and_then(|o| iovs.checked_add(o)) else {
            return Ok(EFAULT);
        };
        let Ok(iov) = read(c, at, 8) else {
            return Ok(EFAULT);
        };
        let word = |range: std::ops::Range<usize>| {
            iov.get(range)
                .and_then(|b| b.try_into().ok())
                .map(u32::from_le_bytes)
                .unwrap_or(0)
        };
        match read(c, word(0..4), word(4..8)) {
            Ok(bytes) => text.extend_from_slice(&bytes),
            Err(_) => return Ok(EFAULT),
        }
    }
    let written = u32::try_from(text.len()).unwrap_or(u32::MAX);
    c.data_mut()
        .write_stdio(fd, &String::from_utf8_lossy(&text));
    Ok(errno(write_u32(c, ret_written, written)))
}

fn fd_read(
    _c: &mut C<'_>,
    _fd: u32,
    _iovs: u32,
    _iovs_len: u32,
    _ret_read: u32,
) -> wasmtime::Result<u32> {
    Ok(ENOSYS)
}

fn fd_close(_c: &mut C<'_>, _fd: u32) -> wasmtime::Result<u32> {
    Ok(ENOSYS)
}

fn fd_seek(
    _c: &mut C<'_>,
    _fd: u32,
    _offset: i64,
    _whence: u32,
    _ret: u32,
) -> wasmtime::Result<u32> {
    Ok(ENOSYS)
}

fn fd_fdstat_get(c: &mut C<'_>, fd: u32, ret: u32) -> wasmtime::Result<u32> {
    if fd > 2 {
        return Ok(EBADF);
    }
    // filetype character_device (2), no flags, no rights.
    let mut stat = [0u8; 24];
    stat[0] = 2;
    Ok(errno(write(c, ret, &stat)))
}

fn fd_fdstat_set_flags(_c: &mut C<'_>, _fd: u32, _flags: u32) -> wasmtime::Result<u32> {
    Ok(ENOSYS)
}

fn fd_prestat_get(_c: &mut C<'_>, _fd: u32, _ret: u32) -> wasmtime::Result<u32> {
    // No preopened directories.
    Ok(EBADF)
}

fn fd_prestat_dir_name(_c: &mut C<'_>, _fd: u32, _ptr: u32, _len: u32) -> wasmtime::Result<u32> {
    Ok(EBADF)
}

fn environ_get(_c: &mut C<'_>, _environ: u32, _buf: u32) -> wasmtime::Result<u32> {
    Ok(SUCCESS)
}

fn environ_sizes_get(c: &mut C<'_>, ret_count: u32, ret_size: u32) -> wasmtime::Result<u32> {
    Ok(errno(
        write_u32(c, ret_count, 0).and_then(|_| write_u32(c, ret_size, 0)),
    ))
}

fn args_get(_c: &mut C<'_>, _argv: u32, _buf: u32) -> wasmtime::Result<u32> {
    Ok(SUCCESS)
}

fn args_sizes_get(c: &mut C<'_>, ret_count: u32, ret_size: u32) -> wasmtime::Result<u32> {
    Ok(errno(
        write_u32(c, ret_count, 0).and_then(|_| write_u32(c, ret_size, 0)),
    ))
}

fn clock_res_get(c: &mut C<'_>, id: u32, ret: u32) -> wasmtime::Result<u32> {
    if id > 3 {
        return Ok(EINVAL);
    }
    Ok(errno(write_u64(c, ret, 1)))
}

/// Realtime (0) reads the virtual wall clock; monotonic and CPU-time clocks (1-3) read its
/// monotonic time.
fn clock_time_get(c: &mut C<'_>, id: u32, _precision: u64, ret: u32) -> wasmtime::Result<u32> {
    let clock = &c.data().clock;
    let now = match id {
        0 => clock.now_nanos(),
        1..=3 => clock.monotonic_nanos(),
        _ => return Ok(EINVAL),
    };
    Ok(errno(write_u64(c, ret, now)))
}

/// Deterministic bytes (seeded by [`ProxyOptions::seed`](super::ProxyOptions::seed) and the worker).
fn random_get(c: &mut C<'_>, ptr: u32, len: u32) -> wasmtime::Result<u32> {
    let size = c.data().memory.map(|m| m.data_size(&*c)).unwrap_or(0);
    if (ptr as usize).saturating_add(len as usize) > size {
        return Ok(EFAULT);
    }
    let mut bytes = Vec::with_capacity(len as usize);
    while bytes.len() < len as usize {
        bytes.extend_from_slice(&c.data_mut().next_random().to_le_bytes());
    }
    bytes.truncate(len as usize);
    Ok(errno(write(c, ptr, &bytes)))
}

fn sched_yield(_c: &mut C<'_>) -> wasmtime::Result<u32> {
    Ok(SUCCESS)
}

fn poll_oneoff(
    _c: &mut C<'_>,
    _subscriptions: u32,
    _events: u32,
    _count: u32,
    _ret: u32,
) -> wasmtime::Result<u32> {
    Ok(ENOSYS)
}
