//! Guest memory access for host calls: bounds-checked, never panicking on guest input.

use wasmtime::Caller;

use super::abi::Status;
use super::vm::VmState;

/// Why a host call stopped: a status for the guest, or a trap (the guest's allocator trapped).
pub(crate) enum Fail {
    Status(Status),
    Trap(wasmtime::Error),
}

impl From<Status> for Fail {
    fn from(status: Status) -> Fail {
        Fail::Status(status)
    }
}

impl From<wasmtime::Error> for Fail {
    fn from(error: wasmtime::Error) -> Fail {
        Fail::Trap(error)
    }
}

pub(crate) type HostResult = Result<(), Fail>;

/// The status word a host call returns, or the trap it raises.
pub(crate) fn status_of(result: HostResult) -> wasmtime::Result<u32> {
    match result {
        Ok(()) => Ok(Status::Ok as u32),
        Err(Fail::Status(status)) => Ok(status as u32),
        Err(Fail::Trap(error)) => Err(error),
    }
}

type C<'a> = Caller<'a, VmState>;

fn range(ptr: u32, len: u32, size: usize) -> Result<std::ops::Range<usize>, Status> {
    let start = ptr as usize;
    let end = start
        .checked_add(len as usize)
        .ok_or(Status::InvalidMemoryAccess)?;
    if end > size {
        return Err(Status::InvalidMemoryAccess);
    }
    Ok(start..end)
}

/// Copies `len` bytes at `ptr` out of the guest.
pub(crate) fn read(caller: &C<'_>, ptr: u32, len: u32) -> Result<Vec<u8>, Status> {
    if len == 0 {
        return Ok(Vec::new());
    }
    let memory = caller.data().memory.ok_or(Status::InvalidMemoryAccess)?;
    let data = memory.data(caller);
    Ok(data[range(ptr, len, data.len())?].to_vec())
}

/// Like [`read`], as text (invalid UTF-8 replaced).
pub(crate) fn read_string(caller: &C<'_>, ptr: u32, len: u32) -> Result<String, Status> {
    read(caller, ptr, len).map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
}

/// Copies `bytes` into the guest at `ptr`.
pub(crate) fn write(caller: &mut C<'_>, ptr: u32, bytes: &[u8]) -> Result<(), Status> {
    let memory = caller.data().memory.ok_or(Status::InvalidMemoryAccess)?;
    let data = memory.data_mut(caller);
    let len = u32::try_from(bytes.len()).map_err(|_| Status::InvalidMemoryAccess)?;
    let range = range(ptr, len, data.len())?;
    data[range].copy_from_slice(bytes);
    Ok(())
}

pub(crate) fn write_u32(caller: &mut C<'_>, ptr: u32, value: u32) -> Result<(), Status> {
    write(caller, ptr, &value.to_le_bytes())
}

pub(crate) fn write_u64(caller: &mut C<'_>, ptr: u32, value: u64) -> Result<(), Status> {
    write(caller, ptr, &value.to_le_bytes())
}

/// Hands `bytes` to the guest the ABI way: allocate with the guest's
/// `proxy_on_memory_allocate`, copy, then store the pointer at `ptr_ptr` and the size at
/// `size_ptr`. Empty data stores a null pointer and size 0 without allocating, as
/// proxy-wasm-cpp-host does.
pub(crate) fn return_bytes(
    caller: &mut C<'_>,
    bytes: &[u8],
    ptr_ptr: u32,
    size_ptr: u32,
) -> HostResult {
    let size = u32::try_from(bytes.len()).map_err(|_| Status::InvalidMemoryAccess)?;
    let mut pointer = 0;
    if size > 0 {
        let allocate = caller
            .data()
            .allocate
            .clone()
            .ok_or(Status::InvalidMemoryAccess)?;
        pointer = allocate.call(&mut *caller, size)?;
        if pointer == 0 {
            return Err(Status::InvalidMemoryAccess.into());
        }
        write(caller, pointer, bytes)?;
    }
    write_u32(caller, ptr_ptr, pointer)?;
    write_u32(caller, size_ptr, size)?;
    Ok(())
}
