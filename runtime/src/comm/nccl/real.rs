//! NCCL itself, through `cudarc::nccl`'s raw bindings (loaded at run time, so a build with
//! `--features cuda` runs without NCCL and says why it is missing).
//!
//! Communicators are created *non-blocking* (`ncclConfig_t::blocking = 0`), so that every
//! call returns at once and [`super::NcclComm`] can poll `ncclCommGetAsyncError` against
//! `comms.timeout` and `ncclCommAbort` a communicator whose peer died, during initialisation
//! as during a collective. A collective on one device's buffers is queued on that device's
//! collective stream, which the communicator orders after the compute stream and before it
//! again with the device driver's events (`device.rs`); the host does not fence the device.
//! Host buffers are staged through device memory on the communicator's own stream, and
//! completion is a CUDA event there.
//!
//! Written from cudarc 0.19's source and NVIDIA's NCCL documentation without a GPU: see
//! `docs/scaling.md` for what the first GPU session must check.

use std::ffi::{c_int, c_void, CStr};
use std::mem::MaybeUninit;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::sys;

use super::api::{NcclHandle, NcclId, NcclLib, NcclOp, Poll};
use super::device::{device_of, STREAM};
use crate::backend::cuda::{CudaDevice, CudaView};
use crate::comm::{BufRef, ReduceOp};
use crate::tensor::{DType, View, ViewMut};
use crate::{Error, Result};

/// `NCCL_CONFIG_UNDEF_INT`: "use NCCL's default" for an integer field of `ncclConfig_t`.
const UNDEF_INT: c_int = c_int::MIN;
/// `ncclConfig_t`'s magic number.
const CONFIG_MAGIC: u32 = 0xcafe_beef;
/// The config layout we fill: NCCL 2.17's prefix (`size` tells NCCL how much to read, so any
/// NCCL from 2.17 on accepts it, whatever headers cudarc was generated from).
const CONFIG_VERSION: u32 = 21700;

/// The NCCL library on GPU `ordinal` of this process.
pub struct RealNccl {
    ctx: Arc<CudaContext>,
}

fn unavailable(why: impl Into<String>) -> Error {
    Error::Unavailable {
        what: "NCCL",
        why: why.into(),
    }
}

/// NCCL's own words for a result code.
fn words(r: sys::ncclResult_t) -> String {
    // SAFETY: ncclGetErrorString returns a static, NUL-terminated string for any code.
    let s = unsafe { sys::ncclGetErrorString(r) };
    if s.is_null() {
        return format!("{r:?}");
    }
    // SAFETY: non-null and NUL-terminated, as above.
    let text = unsafe { CStr::from_ptr(s) }.to_string_lossy();
    format!("{r:?} ({text})")
}

/// `Ok` for success or "in progress" (non-blocking communicators), else NCCL's words.
fn check(what: &str, r: sys::ncclResult_t) -> Result<()> {
    match r {
        sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => Ok(()),
        e => Err(unavailable(format!("{what}: {}", words(e)))),
    }
}

impl RealNccl {
    /// Opens NCCL for GPU `ordinal`; without the driver, a GPU or `libnccl.so`:
    /// [`Error::Unavailable`] saying which, never a panic.
    pub fn open(ordinal: usize) -> Result<Self> {
        // SAFETY: only tries to open the libraries (cudarc panics on calls without them).
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(unavailable(
                "no CUDA driver library (libcuda.so): NCCL needs an NVIDIA GPU and its driver",
            ));
        }
        // SAFETY: as above.
        if !unsafe { sys::is_culib_present() } {
            return Err(unavailable(
                "libnccl.so could not be loaded: install NCCL (e.g. the PyPI wheel \
                 nvidia-nccl-cu12, then `ln -s libnccl.so.2 libnccl.so` in its lib directory) \
                 and put its directory on LD_LIBRARY_PATH",
            ));
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| unavailable(format!("opening GPU {ordinal}: {e:?}")))?;
        Ok(Self { ctx })
    }
}

/// A non-blocking communicator config with NCCL's defaults everywhere else.
fn nonblocking_config() -> sys::ncclConfig_t {
    // SAFETY: an all-zero ncclConfig_t is a valid bit pattern (integers and null pointers).
    let mut c: sys::ncclConfig_t = unsafe { MaybeUninit::zeroed().assume_init() };
    let prefix = std::mem::offset_of!(sys::ncclConfig_t, splitShare) + std::mem::size_of::<c_int>();
    c.size = prefix.next_multiple_of(std::mem::align_of::<sys::ncclConfig_t>());
    c.magic = CONFIG_MAGIC;
    c.version = CONFIG_VERSION;
    c.blocking = 0;
    c.cgaClusterSize = UNDEF_INT;
    c.minCTAs = UNDEF_INT;
    c.maxCTAs = UNDEF_INT;
    c.splitShare = UNDEF_INT;
    c
}

impl NcclLib for RealNccl {
    fn describe(&self) -> String {
        let mut v: c_int = 0;
        // SAFETY: a valid out-pointer.
        let r = unsafe { sys::ncclGetVersion(&mut v) };
        match r {
            sys::ncclResult_t::ncclSuccess => format!("NCCL {}", v),
            e => format!("NCCL (version unknown: {})", words(e)),
        }
    }

    fn unique_id(&self) -> Result<NcclId> {
        let mut id = MaybeUninit::<sys::ncclUniqueId>::uninit();
        // SAFETY: a valid out-pointer; NCCL fills all 128 bytes on success.
        check("ncclGetUniqueId", unsafe {
            sys::ncclGetUniqueId(id.as_mut_ptr())
        })?;
        // SAFETY: initialised by the successful call above.
        let id = unsafe { id.assume_init() };
        Ok(id.internal.map(|c| c as u8))
    }

    fn init(&self, id: &NcclId, world: usize, rank: usize) -> Result<Box<dyn NcclHandle>> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| unavailable(format!("binding the GPU context: {e:?}")))?;
        let uid = sys::ncclUniqueId {
            internal: id.map(|b| b as std::ffi::c_char),
        };
        let (w, r) = (to_int(world)?, to_int(rank)?);
        new_handle(&self.ctx, "ncclCommInitRankConfig", |comm, config| {
            // SAFETY: valid pointers; the config outlives the call (NCCL copies it).
            unsafe { sys::ncclCommInitRankConfig(comm, w, uid, r, config) }
        })
    }
}

/// A communicator on a stream of its own, made by NCCL's `op` (`create`, handed the handle
/// to set and the non-blocking configuration).
fn new_handle(
    ctx: &Arc<CudaContext>,
    op: &str,
    create: impl FnOnce(*mut sys::ncclComm_t, &mut sys::ncclConfig_t) -> sys::ncclResult_t,
) -> Result<Box<dyn NcclHandle>> {
    let stream = ctx
        .new_stream()
        .map_err(|e| unavailable(format!("creating NCCL's stream: {e:?}")))?;
    let mut config = nonblocking_config();
    let mut comm = MaybeUninit::<sys::ncclComm_t>::uninit();
    check(op, create(comm.as_mut_ptr(), &mut config))?;
    // SAFETY: set by the call above (non-blocking: valid, initialisation in progress).
    let comm = unsafe { comm.assume_init() };
    Ok(Box::new(RealHandle::new(Arc::clone(ctx), stream, comm)))
}

fn to_int(v: usize) -> Result<c_int> {
    c_int::try_from(v).map_err(|_| Error::Invalid(format!("{v} does not fit NCCL's int")))
}

/// A collective in flight.
enum Staged {
    /// On a device's collective stream, in place: the communicator marks its end.
    Device,
    /// On the communicator's own stream.
    Own(Own),
}

/// A collective on the communicator's own stream: the device copies of its host buffers
/// (none for a device buffer, which NCCL uses in place) and, once NCCL has really enqueued
/// it, the event after it.
struct Own {
    out: Option<CudaSlice<u8>>,
    _inp: Option<CudaSlice<u8>>,
    /// Recorded only after `ncclCommGetAsyncError` stops saying "in progress": on a
    /// non-blocking communicator a call may return before its kernels are on the stream, and
    /// an event recorded then would complete before the collective ran.
    done: Option<CudaEvent>,
}

/// One NCCL communicator (a raw `ncclComm_t`) and its stream.
struct RealHandle {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    comm: sys::ncclComm_t,
    staged: Option<Staged>,
    aborted: bool,
}

// SAFETY: an ncclComm_t may move between threads as long as one thread uses it at a time,
// which `&mut self` guarantees; every method binds the context to the calling thread first.
unsafe impl Send for RealHandle {}

impl RealHandle {
    fn new(ctx: Arc<CudaContext>, stream: Arc<CudaStream>, comm: sys::ncclComm_t) -> Self {
        Self {
            ctx,
            stream,
            comm,
            staged: None,
            aborted: false,
        }
    }

    fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| unavailable(format!("binding the GPU context: {e:?}")))
    }

    /// `ncclCommGetAsyncError`, with `ncclGetLastError`'s detail on failure.
    fn async_state(&self) -> Poll {
        let mut r = sys::ncclResult_t::ncclSuccess;
        // SAFETY: a live communicator and a valid out-pointer.
        let q = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut r) };
        for code in [q, r] {
            match code {
                sys::ncclResult_t::ncclSuccess => {}
                sys::ncclResult_t::ncclInProgress => return Poll::Pending,
                e => return Poll::Failed(self.describe_error(e)),
            }
        }
        Poll::Done
    }

    fn describe_error(&self, e: sys::ncclResult_t) -> String {
        // SAFETY: returns a NUL-terminated string owned by NCCL, or null.
        let last = unsafe { sys::ncclGetLastError(self.comm) };
        let detail = if last.is_null() {
            String::new()
        } else {
            // SAFETY: non-null and NUL-terminated.
            unsafe { CStr::from_ptr(last) }
                .to_string_lossy()
                .into_owned()
        };
        format!("{} {detail}", words(e)).trim_end().to_string()
    }

    fn upload(&self, b: BufRef<'_>) -> Result<CudaSlice<u8>> {
        self.stream
            .clone_htod(b.bytes())
            .map_err(|e| unavailable(format!("staging to the GPU: {e:?}")))
    }

    fn alloc(&self, bytes: usize) -> Result<CudaSlice<u8>> {
        self.stream
            .alloc_zeros::<u8>(bytes.max(1))
            .map_err(|e| unavailable(format!("allocating a staging buffer: {e:?}")))
    }

    /// Enqueues `op` on its device's collective stream when all its buffers are that
    /// device's, else on the communicator's stream with its host buffers staged.
    fn launch(&mut self, op: &NcclOp<'_>) -> Result<Staged> {
        let Some(dev) = device_of(op) else {
            return self.launch_staged(op).map(Staged::Own);
        };
        let s = self.device_stream(&dev)?;
        let (input, output) = buffers(op);
        let (ip, opp) = (
            input.device_ptr() as *const c_void,
            output.device_ptr() as *mut c_void,
        );
        // SAFETY: the op's own device buffers, borrowed until the host returns; the compute
        // stream waits for the collective's end before it reads or writes them again.
        let r = unsafe { enqueue(op, ip, opp, nccl_type(op_dtype(op)), self.comm, s)? };
        check(op.name(), r)?;
        Ok(Staged::Device)
    }

    /// The raw collective stream of `dev`, which must be this communicator's GPU.
    fn device_stream(&self, dev: &CudaDevice) -> Result<sys::cudaStream_t> {
        let (theirs, ours) = (dev.info().ordinal, self.ctx.ordinal());
        if theirs != ours {
            return Err(Error::Invalid(format!(
                "a collective on buffers of GPU {theirs} over the NCCL communicator of GPU {ours}"
            )));
        }
        let raw = dev.driver().native_stream(STREAM).ok_or_else(|| {
            unavailable("the buffers' device is the CPU emulator; NCCL needs a GPU's streams")
        })?;
        Ok(raw as usize as sys::cudaStream_t)
    }

    /// Enqueues `op` on the communicator's stream, with device copies of its host buffers.
    fn launch_staged(&mut self, op: &NcclOp<'_>) -> Result<Own> {
        let (input, output) = buffers(op);
        // A device buffer next to a host one (no caller passes such a pair): this stream does
        // not wait for the compute stream that wrote it, so the host does.
        for dev in [input.device(), output.device()].into_iter().flatten() {
            dev.synchronize()?;
        }
        let inp = match input {
            Place::Device(_) => None,
            Place::Host(b, _) => Some(self.upload(b)?),
        };
        let mut out = match output {
            Place::Device(_) => None,
            Place::Host(_, bytes) => Some(self.alloc(bytes)?),
        };
        let s = self.stream.cu_stream() as sys::cudaStream_t;
        let t = nccl_type(op_dtype(op));
        {
            let (ip, _gi) = match &inp {
                Some(b) => {
                    let (p, g) = b.device_ptr(&self.stream);
                    (p, Some(g))
                }
                None => (input.device_ptr(), None),
            };
            let (opp, _go) = match &mut out {
                Some(b) => {
                    let (p, g) = b.device_ptr_mut(&self.stream);
                    (p, Some(g))
                }
                None => (output.device_ptr(), None),
            };
            let (ip, opp) = (ip as *const c_void, opp as *mut c_void);
            // SAFETY: device buffers of the sizes NCCL reads and writes: the op's own (borrowed
            // until the collective has completed) or staging copies kept in `Staged`.
            let r = unsafe { enqueue(op, ip, opp, t, self.comm, s)? };
            check(op.name(), r)?;
        }
        Ok(Own {
            out,
            _inp: inp,
            done: None,
        })
    }
}

/// Where one of an op's buffers lives: device memory (its address), or host memory (the
/// elements to upload, and the bytes to stage).
#[derive(Clone, Copy)]
enum Place<'a> {
    Device(CudaView<'a>),
    Host(BufRef<'a>, usize),
}

impl Place<'_> {
    fn of(v: View<'_>) -> Place<'_> {
        match v {
            View::Cuda(c) => Place::Device(c),
            View::Host(b) => Place::Host(b, b.len() * b.dtype().size()),
            // `NcclComm::run` refuses size-only buffers before any launch.
            View::Meta(_) => Place::Host(BufRef::F32(&[]), 0),
        }
    }

    fn device(&self) -> Option<&Arc<crate::backend::cuda::CudaDevice>> {
        match self {
            Place::Device(c) => Some(c.device()),
            Place::Host(..) => None,
        }
    }

    fn device_ptr(&self) -> u64 {
        match self {
            Place::Device(c) => c.ptr().0,
            Place::Host(..) => 0,
        }
    }
}

/// The input and output of `op` (the same buffer for the in-place ones).
fn buffers<'a>(op: &'a NcclOp<'_>) -> (Place<'a>, Place<'a>) {
    match op {
        NcclOp::AllReduce { buf, .. } | NcclOp::Broadcast { buf, .. } => {
            let p = Place::of(buf.as_view());
            (p, p)
        }
        NcclOp::ReduceScatter { input, output, .. }
        | NcclOp::AllGather { input, output }
        | NcclOp::AllToAll { input, output } => (Place::of(*input), Place::of(output.as_view())),
    }
}

fn op_dtype(op: &NcclOp<'_>) -> DType {
    match op {
        NcclOp::AllReduce { buf, .. } | NcclOp::Broadcast { buf, .. } => buf.dtype(),
        NcclOp::ReduceScatter { output, .. }
        | NcclOp::AllGather { output, .. }
        | NcclOp::AllToAll { output, .. } => output.dtype(),
    }
}

fn nccl_type(d: DType) -> sys::ncclDataType_t {
    match d {
        DType::F32 => sys::ncclDataType_t::ncclFloat32,
        DType::Bf16 => sys::ncclDataType_t::ncclBfloat16,
        DType::F16 => sys::ncclDataType_t::ncclFloat16,
    }
}

fn nccl_op(op: ReduceOp) -> sys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => sys::ncclRedOp_t::ncclMax,
    }
}

/// Calls the NCCL function for `op` on device pointers.
///
/// # Safety
/// `ip`/`opp` must be device buffers of the lengths `op` describes, on `comm`'s device.
unsafe fn enqueue(
    op: &NcclOp<'_>,
    ip: *const c_void,
    opp: *mut c_void,
    t: sys::ncclDataType_t,
    comm: sys::ncclComm_t,
    s: sys::cudaStream_t,
) -> Result<sys::ncclResult_t> {
    // SAFETY (all calls): the caller's contract.
    Ok(match op {
        NcclOp::AllReduce { buf, op } => unsafe {
            sys::ncclAllReduce(ip, opp, buf.len(), t, nccl_op(*op), comm, s)
        },
        NcclOp::ReduceScatter { output, op, .. } => unsafe {
            sys::ncclReduceScatter(ip, opp, output.len(), t, nccl_op(*op), comm, s)
        },
        NcclOp::AllGather { input, .. } => unsafe {
            sys::ncclAllGather(ip, opp, input.len(), t, comm, s)
        },
        NcclOp::Broadcast { buf, root } => unsafe {
            sys::ncclBroadcast(ip, opp, buf.len(), t, to_int(*root)?, comm, s)
        },
        NcclOp::AllToAll { input, output } => unsafe {
            all_to_all(input, output, ip, opp, t, comm, s)?
        },
    })
}

/// Grouped sends and receives: chunk `r` to and from rank `r`.
///
/// # Safety
/// As [`enqueue`].
unsafe fn all_to_all(
    input: &View<'_>,
    output: &ViewMut<'_>,
    ip: *const c_void,
    opp: *mut c_void,
    t: sys::ncclDataType_t,
    comm: sys::ncclComm_t,
    s: sys::cudaStream_t,
) -> Result<sys::ncclResult_t> {
    let mut world: c_int = 0;
    // SAFETY: a live communicator and a valid out-pointer.
    check("ncclCommCount", unsafe {
        sys::ncclCommCount(comm, &mut world)
    })?;
    let world = world.max(1) as usize;
    let n = output.len() / world;
    let bytes = n * input.dtype().size();
    // SAFETY: group calls only queue work.
    check("ncclGroupStart", unsafe { sys::ncclGroupStart() })?;
    for r in 0..world {
        let peer = to_int(r)?;
        // SAFETY: chunk r of each buffer is in bounds (`world * n` elements).
        unsafe {
            check(
                "ncclSend",
                sys::ncclSend(ip.byte_add(r * bytes), n, t, peer, comm, s),
            )?;
            check(
                "ncclRecv",
                sys::ncclRecv(opp.byte_add(r * bytes), n, t, peer, comm, s),
            )?;
        }
    }
    // SAFETY: closes the group opened above.
    Ok(unsafe { sys::ncclGroupEnd() })
}

/// Copies the staged result into the op's host output (a device output NCCL wrote in place).
fn download(
    stream: &Arc<CudaStream>,
    out: Option<&CudaSlice<u8>>,
    op: &mut NcclOp<'_>,
) -> Result<()> {
    let dst = match op {
        NcclOp::AllReduce { buf, .. } | NcclOp::Broadcast { buf, .. } => buf.reborrow(),
        NcclOp::ReduceScatter { output, .. }
        | NcclOp::AllGather { output, .. }
        | NcclOp::AllToAll { output, .. } => output.reborrow(),
    };
    let (Some(out), ViewMut::Host(dst)) = (out, dst) else {
        return Ok(());
    };
    let bytes = dst.bytes_mut();
    let n = bytes.len();
    if n == 0 {
        return Ok(());
    }
    stream
        .memcpy_dtoh(&out.slice(0..n), bytes)
        .and_then(|()| stream.synchronize())
        .map_err(|e| unavailable(format!("copying the result from the GPU: {e:?}")))
}

impl NcclHandle for RealHandle {
    fn poll_init(&mut self) -> Poll {
        if let Err(e) = self.bind() {
            return Poll::Failed(e.to_string());
        }
        self.async_state()
    }

    fn start(&mut self, op: &mut NcclOp<'_>) -> Result<()> {
        self.bind()?;
        self.staged = Some(self.launch(op)?);
        Ok(())
    }

    fn poll_enqueued(&mut self, _op: &mut NcclOp<'_>) -> Poll {
        if let Err(e) = self.bind() {
            return Poll::Failed(e.to_string());
        }
        match self.async_state() {
            Poll::Done => {}
            other => return other, // still enqueueing (non-blocking communicator), or failed
        }
        match &mut self.staged {
            Some(Staged::Own(own)) if own.done.is_none() => match self.stream.record_event(None) {
                Ok(e) => own.done = Some(e),
                Err(e) => return Poll::Failed(format!("recording an event: {e:?}")),
            },
            Some(_) => {}
            None => return Poll::Failed("poll without a started collective".into()),
        }
        Poll::Done
    }

    fn poll(&mut self, op: Option<&mut NcclOp<'_>>) -> Poll {
        if let Err(e) = self.bind() {
            return Poll::Failed(e.to_string());
        }
        let state = self.async_state();
        if let Poll::Failed(why) = state {
            return Poll::Failed(why);
        }
        let stream = Arc::clone(&self.stream);
        let own = match (&self.staged, op) {
            (Some(Staged::Device), _) => {
                // The communicator's event on the device's stream says when it finished.
                self.staged = None;
                return Poll::Done;
            }
            (Some(Staged::Own(own)), Some(op)) => (own, op),
            (Some(Staged::Own(_)), None) => {
                return Poll::Failed("a staged collective polled without its buffers".into())
            }
            (None, _) => return Poll::Failed("poll without a started collective".into()),
        };
        let (st, op) = own;
        let outcome = match st.done.as_ref().map(CudaEvent::try_is_complete) {
            Some(Ok(false)) | None => return Poll::Pending,
            Some(Ok(true)) => download(&stream, st.out.as_ref(), op),
            Some(Err(e)) => return Poll::Failed(format!("CUDA error while NCCL ran: {e:?}")),
        };
        self.staged = None;
        match outcome {
            Ok(()) => Poll::Done,
            Err(e) => Poll::Failed(e.to_string()),
        }
    }

    fn abort(&mut self) {
        if !self.aborted {
            self.aborted = true;
            let _ = self.bind();
            // SAFETY: a live communicator, aborted once; NCCL stops its kernels.
            let _ = unsafe { sys::ncclCommAbort(self.comm) };
        }
    }

    fn split(
        &mut self,
        color: usize,
        key: usize,
        _rank: usize,
        _world: usize,
    ) -> Result<Box<dyn NcclHandle>> {
        self.bind()?;
        let (c, k) = (to_int(color)?, to_int(key)?);
        new_handle(&self.ctx, "ncclCommSplit", |comm, config| {
            // SAFETY: a live parent and valid pointers.
            unsafe { sys::ncclCommSplit(self.comm, c, k, comm, config) }
        })
    }
}

impl Drop for RealHandle {
    /// Buffers go first, then the communicator (aborted: nothing is in flight any more, and
    /// abort never waits for peers, unlike a finalize).
    fn drop(&mut self) {
        self.staged = None;
        self.abort();
    }
}
