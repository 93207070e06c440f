//! A global allocator for `agq-bench` that tells apart the live heap of the
//! in-process AGQ server from that of the simulated clients. Every block
//! carries a 16-byte header holding the side of the thread that allocated
//! it (by thread name: `agq-srv`, `agq-writer`, `agq-checkpoint`, `r2d2`
//! are the server; `bench-cli` the clients), so a block freed on another
//! thread is still taken off the right side.
//!
//! The process RSS covers both sides; `RSS - client heap` is an upper bound
//! of what the server alone would use (it keeps the code, the stacks and
//! the allocator's slack on the server's side).

use std::{
    alloc::{GlobalAlloc, Layout, System},
    cell::Cell,
    sync::atomic::{AtomicIsize, AtomicUsize, Ordering},
};

/// The server's threads.
pub const SERVER: usize = 0;
/// The simulated clients' threads.
pub const CLIENT: usize = 1;
/// Anything else (the main thread, redis helpers, ...).
pub const OTHER: usize = 2;

/// Counters of one shard, on a cache line of their own: one global set of
/// counters, written by every allocation of every thread, made the cache
/// line travel between the cores at each allocation (5 % of the server's
/// and the clients' CPU in a profile of the peak run).
#[repr(align(128))]
struct Shard([AtomicIsize; 3]);

/// How many shards; threads beyond this count share them.
const SHARDS: usize = 32;

/// The live bytes of each side, split over shards: a thread adds to and
/// subtracts from its own shard (a block freed on another thread than the
/// one that allocated it is taken off the freeing thread's shard), and a
/// side's live heap is the sum over all shards.
static LIVE: [Shard; SHARDS] = [const { Shard([const { AtomicIsize::new(0) }; 3]) }; SHARDS];

/// The next shard handed to a thread.
static NEXT_SHARD: AtomicUsize = AtomicUsize::new(0);

/// Live heap bytes allocated by `side` ([`SERVER`], [`CLIENT`], [`OTHER`]);
/// `None` when [`Tagged`] is not the process's global allocator (`agq
/// bench` runs the bench without it: only the `agq-bench` binary installs
/// it), which shows as no bytes counted on any side.
pub fn live(side: usize) -> Option<u64> {
    let total = |s: usize| -> isize {
        LIVE.iter()
            .map(|shard| shard.0[s].load(Ordering::Relaxed))
            .fold(0isize, isize::wrapping_add)
    };
    if (0..3).all(|s| total(s) == 0) {
        return None;
    }
    (side < 3).then(|| total(side).max(0) as u64)
}

/// Adds `bytes` (negative: takes them off) to `side`'s count in this
/// thread's shard.
fn count(side: usize, bytes: isize) {
    let shard = SHARD
        .try_with(|s| {
            let v = s.get();
            if v != usize::MAX {
                return v;
            }
            let v = NEXT_SHARD.fetch_add(1, Ordering::Relaxed) % SHARDS;
            s.set(v);
            v
        })
        .unwrap_or(0);
    LIVE[shard].0[side.min(OTHER)].fetch_add(bytes, Ordering::Relaxed);
}

const UNKNOWN: u8 = 255;

thread_local! {
    static SIDE: Cell<u8> = const { Cell::new(UNKNOWN) };
    static LOOKUPS: Cell<u8> = const { Cell::new(0) };
    static SHARD: Cell<usize> = const { Cell::new(usize::MAX) };
}

/// The side of this thread, from its name, without allocating.
fn lookup() -> u8 {
    let mut name = [0u8; 17];
    // SAFETY: PR_GET_NAME writes at most 16 bytes (NUL included) into the buffer.
    let rc = unsafe {
        libc::prctl(
            libc::PR_GET_NAME,
            name.as_mut_ptr() as libc::c_ulong,
            0,
            0,
            0,
        )
    };
    if rc != 0 {
        return OTHER as u8;
    }
    let n = name.iter().position(|&b| b == 0).unwrap_or(16);
    let name = &name[..n];
    let server: [&[u8]; 4] = [b"agq-srv", b"agq-writer", b"agq-checkpoint", b"r2d2"];
    if server.iter().any(|p| name.starts_with(p)) {
        SERVER as u8
    } else if name.starts_with(b"bench-cli") {
        CLIENT as u8
    } else {
        OTHER as u8
    }
}

fn side() -> u8 {
    SIDE.try_with(|s| {
        let v = s.get();
        if v != UNKNOWN {
            return v;
        }
        let found = lookup();
        // A thread may allocate before it is named: look again a few times
        // before settling on OTHER.
        let tries = LOOKUPS.try_with(|l| {
            l.set(l.get().saturating_add(1));
            l.get()
        });
        if found != OTHER as u8 || tries.is_ok_and(|t| t > 32) {
            s.set(found);
        }
        found
    })
    .unwrap_or(OTHER as u8)
}

/// The bench's global allocator: the side header on every block, which
/// also says where the block lives. The server's blocks come from
/// mimalloc, the allocator the `agq` binary runs on; everything else (the
/// simulated clients of AGQ and of the peers, the harness) from the
/// system allocator, so a change of the server's allocator changes only
/// the server's figures.
pub struct Tagged;

/// Allocates `l` on the allocator of `side`.
///
/// # Safety
/// As [`GlobalAlloc::alloc`].
unsafe fn inner_alloc(side: u8, l: Layout) -> *mut u8 {
    // SAFETY: forwarded from the caller.
    unsafe {
        if side == SERVER as u8 {
            mimalloc::MiMalloc.alloc(l)
        } else {
            System.alloc(l)
        }
    }
}

/// Frees a block that [`inner_alloc`] gave out for `side`.
///
/// # Safety
/// As [`GlobalAlloc::dealloc`], with `side` the side the block was
/// allocated for.
unsafe fn inner_dealloc(side: usize, base: *mut u8, l: Layout) {
    // SAFETY: forwarded from the caller.
    unsafe {
        if side == SERVER {
            mimalloc::MiMalloc.dealloc(base, l)
        } else {
            System.dealloc(base, l)
        }
    }
}

/// Resizes a block that [`inner_alloc`] gave out for `side`.
///
/// # Safety
/// As [`GlobalAlloc::realloc`], with `side` the side the block was
/// allocated for.
unsafe fn inner_realloc(side: usize, base: *mut u8, l: Layout, new_size: usize) -> *mut u8 {
    // SAFETY: forwarded from the caller.
    unsafe {
        if side == SERVER {
            mimalloc::MiMalloc.realloc(base, l, new_size)
        } else {
            System.realloc(base, l, new_size)
        }
    }
}

const HEADER: usize = 16;

fn outer(layout: Layout) -> Option<(Layout, usize)> {
    let header = HEADER.max(layout.align());
    let l = Layout::from_size_align(
        layout.size().checked_add(header)?,
        layout.align().max(HEADER),
    )
    .ok()?;
    Some((l, header))
}

// SAFETY: every block handed out is `header` bytes into a block of the
// allocator of the side written in its first header byte, allocated with
// the outer layout; dealloc and realloc undo exactly that on the same
// allocator (the side byte is never changed after alloc).
unsafe impl GlobalAlloc for Tagged {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some((outer_l, header)) = outer(layout) else {
            return std::ptr::null_mut();
        };
        let s = side();
        // SAFETY: outer_l has a non-zero size.
        let base = unsafe { inner_alloc(s, outer_l) };
        if base.is_null() {
            return base;
        }
        // SAFETY: base is valid for outer_l.size() >= header bytes.
        unsafe {
            *base = s;
            count(s as usize, layout.size() as isize);
            base.add(header)
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let Some((outer_l, header)) = outer(layout) else {
            return;
        };
        // SAFETY: ptr came from alloc/realloc with the same layout.
        unsafe {
            let base = ptr.sub(header);
            let s = (*base as usize).min(OTHER);
            count(s, -(layout.size() as isize));
            inner_dealloc(s, base, outer_l);
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let Some((outer_l, header)) = outer(layout) else {
            return std::ptr::null_mut();
        };
        let Some(new_outer) = new_size.checked_add(header) else {
            return std::ptr::null_mut();
        };
        // SAFETY: ptr came from alloc/realloc with `layout`; realloc keeps
        // the header bytes (they are part of the block).
        unsafe {
            let base = ptr.sub(header);
            let s = (*base as usize).min(OTHER);
            let nb = inner_realloc(s, base, outer_l, new_outer);
            if nb.is_null() {
                return nb;
            }
            count(s, new_size as isize - layout.size() as isize);
            nb.add(header)
        }
    }
}
