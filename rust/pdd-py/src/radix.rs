//! The decode-side radix prefix cache and its mirror, for Python.
//!
//! Token arrays come in without a copy when they are 1-D contiguous numpy uint32 (or
//! int32, checked non-negative) arrays; int64 arrays and lists are converted. Long
//! operations (>= `DETACH_TOKENS` tokens, batches, big evictions) run with the GIL
//! released; short ones keep it, because releasing costs more than they take.

use std::sync::{Arc, Mutex};

use numpy::{PyArray1, PyReadonlyArray1, PyUntypedArrayMethods};
use pdd_core::radix::{self, hash, Mirror, NodeRef, Snapshot, StoredPages};
use pdd_core::wire::{self, Frame};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::errors::{invalid, PddErr};

/// Operations on at least this many tokens release the GIL.
const DETACH_TOKENS: usize = 8192;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<RadixCache>()?;
    m.add_class::<RadixNode>()?;
    m.add_class::<RadixMatch>()?;
    m.add_class::<RadixInsert>()?;
    m.add_class::<PrefixMirror>()?;
    m.add_function(wrap_pyfunction!(chain_hashes, m)?)?;
    Ok(())
}

/// Token IDs borrowed from a numpy array where possible.
enum Tokens<'py> {
    U32(PyReadonlyArray1<'py, u32>),
    I32(PyReadonlyArray1<'py, i32>),
    Owned(Vec<u32>),
}

impl<'py> Tokens<'py> {
    fn extract(obj: &Bound<'py, PyAny>, field: &str) -> PyResult<Tokens<'py>> {
        if let Ok(a) = obj.extract::<PyReadonlyArray1<'py, u32>>() {
            if a.is_contiguous() {
                return Ok(Tokens::U32(a));
            }
            return Ok(Tokens::Owned(a.as_array().to_vec()));
        }
        if let Ok(a) = obj.extract::<PyReadonlyArray1<'py, i32>>() {
            if a.is_contiguous() {
                let neg = a
                    .as_slice()
                    .map(|s| s.iter().fold(0i32, |acc, &t| acc | t) < 0)
                    .unwrap_or(true);
                if neg {
                    return Err(invalid(format!("{field}: token ids must be >= 0")));
                }
                return Ok(Tokens::I32(a));
            }
        }
        crate::convert::u32s_from_py(obj, field).map(Tokens::Owned)
    }

    fn slice(&self) -> &[u32] {
        match self {
            // Contiguity was checked at extraction, so as_slice cannot fail here.
            Tokens::U32(a) => a.as_slice().unwrap_or(&[]),
            Tokens::I32(a) => bytemuck::cast_slice(a.as_slice().unwrap_or(&[])),
            Tokens::Owned(v) => v,
        }
    }
}

/// An opaque reference to the node that ends a cached prefix: lock it, unlock it, or
/// resume the next turn from it. Stale once its pages are evicted (operations then
/// raise `InvalidArgument` with reason `radix_stale_node`).
#[pyclass(frozen, module = "pdd_transport._native")]
#[derive(Clone, Copy)]
pub struct RadixNode {
    node: NodeRef,
}

#[pymethods]
impl RadixNode {
    /// The namespace of the prefix.
    #[getter]
    fn namespace(&self) -> u64 {
        self.node.namespace()
    }

    /// True for the empty prefix (nothing to lock).
    #[getter]
    fn is_root(&self) -> bool {
        self.node.is_root()
    }

    fn __repr__(&self) -> String {
        format!(
            "RadixNode(namespace={}, root={})",
            self.node.namespace(),
            self.node.is_root()
        )
    }
}

/// What a match found.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct RadixMatch {
    /// Tokens matched (a multiple of the page size).
    #[pyo3(get)]
    matched_tokens: usize,
    /// Page handles of the matched pages (uint32).
    #[pyo3(get)]
    handles: Py<PyArray1<u32>>,
    /// The node ending the match.
    #[pyo3(get)]
    node: Py<RadixNode>,
    /// Chain hash of the matched prefix (what PREFIX_REPLY carries).
    #[pyo3(get)]
    prefix_hash: u64,
}

/// What an insert did.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct RadixInsert {
    /// Tokens that were already cached.
    #[pyo3(get)]
    cached_tokens: usize,
    /// The caller's handles for pages the tree already had: free them (uint32).
    #[pyo3(get)]
    duplicates: Py<PyArray1<u32>>,
    /// The node ending the inserted sequence.
    #[pyo3(get)]
    node: Py<RadixNode>,
}

fn match_to_py(py: Python<'_>, m: radix::MatchResult) -> PyResult<RadixMatch> {
    Ok(RadixMatch {
        matched_tokens: m.matched_tokens,
        handles: PyArray1::from_vec(py, m.handles).unbind(),
        node: Py::new(py, RadixNode { node: m.node })?,
        prefix_hash: m.prefix_hash,
    })
}

fn insert_to_py(py: Python<'_>, r: radix::InsertResult) -> PyResult<RadixInsert> {
    Ok(RadixInsert {
        cached_tokens: r.cached_tokens,
        duplicates: PyArray1::from_vec(py, r.duplicates).unbind(),
        node: Py::new(py, RadixNode { node: r.node })?,
    })
}

/// A page-granular radix tree of cached token prefixes, one per decode instance.
/// Thread-safe (an internal lock); see docs/radix.md.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct RadixCache {
    /// Shared with a `KvReceiver` that answers prefix queries from it.
    cache: Arc<Mutex<radix::RadixCache>>,
}

impl RadixCache {
    /// The cache itself, for a receiver that answers PREFIX_QUERY from it.
    pub fn shared(&self) -> Arc<Mutex<radix::RadixCache>> {
        self.cache.clone()
    }

    fn with<T>(&self, f: impl FnOnce(&mut radix::RadixCache) -> T) -> T {
        let mut guard = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut guard)
    }

    fn with_detached<T: Send>(
        &self,
        py: Python<'_>,
        detach: bool,
        f: impl FnOnce(&mut radix::RadixCache) -> T + Send,
    ) -> T {
        if detach {
            py.detach(|| self.with(f))
        } else {
            self.with(f)
        }
    }
}

#[pymethods]
impl RadixCache {
    #[new]
    #[pyo3(signature = (page_size = 64))]
    fn new(page_size: usize) -> PyResult<Self> {
        Ok(RadixCache {
            cache: Arc::new(Mutex::new(
                radix::RadixCache::new(page_size).map_err(PddErr)?,
            )),
        })
    }

    /// Tokens per page.
    #[getter]
    fn page_size(&self) -> usize {
        self.with(|c| c.page_size())
    }

    /// Longest cached whole-page prefix of `tokens` in `namespace`.
    #[pyo3(signature = (tokens, namespace = 0))]
    fn match_prefix(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        namespace: u64,
    ) -> PyResult<RadixMatch> {
        let t = Tokens::extract(tokens, "tokens")?;
        let s = t.slice();
        let m = self.with_detached(py, s.len() >= DETACH_TOKENS, |c| {
            c.match_prefix(namespace, s)
        });
        match_to_py(py, m)
    }

    /// Continue a match from `node` with the tokens that follow its prefix.
    fn match_from(
        &self,
        py: Python<'_>,
        node: &RadixNode,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<RadixMatch> {
        let t = Tokens::extract(tokens, "tokens")?;
        let s = t.slice();
        let n = node.node;
        let m = self
            .with_detached(py, s.len() >= DETACH_TOKENS, |c| c.match_from(n, s))
            .map_err(PddErr)?;
        match_to_py(py, m)
    }

    /// How many leading tokens are cached, changing nothing.
    #[pyo3(signature = (tokens, namespace = 0))]
    fn peek_prefix(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        namespace: u64,
    ) -> PyResult<usize> {
        let t = Tokens::extract(tokens, "tokens")?;
        let s = t.slice();
        Ok(self.with_detached(py, s.len() >= DETACH_TOKENS, |c| {
            c.peek_prefix(namespace, s)
        }))
    }

    /// Cache `tokens` (whole pages) with one handle per page.
    #[pyo3(signature = (tokens, handles, namespace = 0))]
    fn insert(
        &self,
        py: Python<'_>,
        tokens: &Bound<'_, PyAny>,
        handles: &Bound<'_, PyAny>,
        namespace: u64,
    ) -> PyResult<RadixInsert> {
        let t = Tokens::extract(tokens, "tokens")?;
        let h = Tokens::extract(handles, "handles")?;
        let (s, hs) = (t.slice(), h.slice());
        let r = self
            .with_detached(py, s.len() >= DETACH_TOKENS, |c| c.insert(namespace, s, hs))
            .map_err(PddErr)?;
        insert_to_py(py, r)
    }

    /// Continue an insert from `node`: `tokens` (whole pages) follow its prefix.
    fn insert_from(
        &self,
        py: Python<'_>,
        node: &RadixNode,
        tokens: &Bound<'_, PyAny>,
        handles: &Bound<'_, PyAny>,
    ) -> PyResult<RadixInsert> {
        let t = Tokens::extract(tokens, "tokens")?;
        let h = Tokens::extract(handles, "handles")?;
        let (s, hs, n) = (t.slice(), h.slice(), node.node);
        let r = self
            .with_detached(py, s.len() >= DETACH_TOKENS, |c| c.insert_from(n, s, hs))
            .map_err(PddErr)?;
        insert_to_py(py, r)
    }

    /// Match many prompts at once (one call, GIL released): prompt `i` is
    /// `flat_tokens[offsets[i]:offsets[i+1]]`.
    #[pyo3(signature = (flat_tokens, offsets, namespace = 0))]
    fn match_batch(
        &self,
        py: Python<'_>,
        flat_tokens: &Bound<'_, PyAny>,
        offsets: &Bound<'_, PyAny>,
        namespace: u64,
    ) -> PyResult<Vec<RadixMatch>> {
        let t = Tokens::extract(flat_tokens, "flat_tokens")?;
        let o = offsets_from_py(offsets, t.slice().len())?;
        let s = t.slice();
        let results = self.with_detached(py, true, |c| {
            o.windows(2)
                .map(|w| c.match_prefix(namespace, &s[w[0]..w[1]]))
                .collect::<Vec<_>>()
        });
        results.into_iter().map(|m| match_to_py(py, m)).collect()
    }

    /// Insert many sequences at once: sequence `i` is `flat_tokens[offsets[i]:offsets[i+1]]`
    /// with handles `flat_handles[handle_offsets[i]:handle_offsets[i+1]]`. Stops at the
    /// first error (earlier inserts stay).
    #[pyo3(signature = (flat_tokens, offsets, flat_handles, handle_offsets, namespace = 0))]
    fn insert_batch(
        &self,
        py: Python<'_>,
        flat_tokens: &Bound<'_, PyAny>,
        offsets: &Bound<'_, PyAny>,
        flat_handles: &Bound<'_, PyAny>,
        handle_offsets: &Bound<'_, PyAny>,
        namespace: u64,
    ) -> PyResult<Vec<RadixInsert>> {
        let t = Tokens::extract(flat_tokens, "flat_tokens")?;
        let h = Tokens::extract(flat_handles, "flat_handles")?;
        let o = offsets_from_py(offsets, t.slice().len())?;
        let ho = offsets_from_py(handle_offsets, h.slice().len())?;
        if o.len() != ho.len() {
            return Err(invalid(
                "offsets and handle_offsets must describe the same number of sequences",
            ));
        }
        let (s, hs) = (t.slice(), h.slice());
        let results = self.with_detached(py, true, |c| {
            let mut out = Vec::with_capacity(o.len().saturating_sub(1));
            for (w, hw) in o.windows(2).zip(ho.windows(2)) {
                out.push(c.insert(namespace, &s[w[0]..w[1]], &hs[hw[0]..hw[1]])?);
            }
            Ok::<_, pdd_core::Error>(out)
        });
        results
            .map_err(PddErr)?
            .into_iter()
            .map(|r| insert_to_py(py, r))
            .collect()
    }

    /// Pin the prefix ended by `node` (locks nest).
    fn lock(&self, node: &RadixNode) -> PyResult<()> {
        self.with(|c| c.lock(node.node))
            .map_err(|e| PddErr(e).into())
    }

    /// Undo one `lock`.
    fn unlock(&self, node: &RadixNode) -> PyResult<()> {
        self.with(|c| c.unlock(node.node))
            .map_err(|e| PddErr(e).into())
    }

    /// Evict up to `n_pages` least recently used unlocked pages; returns their handles.
    fn evict<'py>(&self, py: Python<'py>, n_pages: usize) -> Bound<'py, PyArray1<u32>> {
        let freed = self.with_detached(py, n_pages >= 4096, |c| c.evict(n_pages));
        PyArray1::from_vec(py, freed)
    }

    /// Empty the cache (refused while anything is locked); returns every handle.
    fn clear<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let freed = self.with(|c| c.clear()).map_err(PddErr)?;
        Ok(PyArray1::from_vec(py, freed))
    }

    /// `{"pages", "locked_pages", "evictable_pages", "evictable_leaves", "nodes",
    /// "heap_bytes", "last_event_id"}`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (s, heap, last) = self.with(|c| (c.stats(), c.heap_bytes(), c.last_event_id()));
        let d = PyDict::new(py);
        d.set_item("pages", s.pages)?;
        d.set_item("locked_pages", s.locked_pages)?;
        d.set_item("evictable_pages", s.evictable_pages)?;
        d.set_item("evictable_leaves", s.evictable_leaves)?;
        d.set_item("nodes", s.nodes)?;
        d.set_item("heap_bytes", heap)?;
        d.set_item("last_event_id", last)?;
        Ok(d)
    }

    /// Take the events emitted since the last call, as CACHE_EVENTS frames of
    /// `source_id` (encoded bytes, ready for a mirror or the wire).
    fn drain_event_frames<'py>(
        &self,
        py: Python<'py>,
        source_id: u64,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let events = self.with(|c| c.drain_events());
        encode_frames(py, radix::to_wire(source_id, events))
    }

    /// The whole cache as one snapshot: `(last_event_id, frames)` where `frames` are
    /// CACHE_EVENTS frames of `Stored` runs (their event ids are meaningless; pass the
    /// frames to `PrefixMirror.resync`).
    fn snapshot_frames<'py>(
        &self,
        py: Python<'py>,
        source_id: u64,
    ) -> PyResult<(u64, Vec<Bound<'py, PyBytes>>)> {
        let snap = self.with(|c| c.snapshot());
        let events = snap.to_wire_events();
        let frames = events
            .chunks(4096)
            .map(|chunk| wire::CacheEvents {
                source_id,
                first_event_id: 0,
                events: chunk.to_vec(),
            })
            .collect();
        Ok((snap.last_event_id, encode_frames(py, frames)?))
    }
}

fn encode_frames<'py>(
    py: Python<'py>,
    frames: Vec<wire::CacheEvents>,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    frames
        .into_iter()
        .map(|f| {
            let bytes = wire::encode_frame_to_vec(&Frame::CacheEvents(f), wire::HARD_MAX_PAYLOAD)
                .map_err(PddErr)?;
            Ok(PyBytes::new(py, &bytes))
        })
        .collect()
}

fn offsets_from_py(obj: &Bound<'_, PyAny>, len: usize) -> PyResult<Vec<usize>> {
    let o = crate::convert::u32s_from_py(obj, "offsets")?;
    if o.first() != Some(&0)
        || o.last().map(|&l| l as usize) != Some(len)
        || o.windows(2).any(|w| w[0] > w[1])
    {
        return Err(invalid(format!(
            "offsets must start at 0, never decrease, and end at the flat array's length {len}"
        )));
    }
    Ok(o.into_iter().map(|x| x as usize).collect())
}

fn frame_events(data: &[u8]) -> PyResult<wire::CacheEvents> {
    match wire::decode_frame(data, wire::HARD_MAX_PAYLOAD).map_err(PddErr)? {
        Some((Frame::CacheEvents(c), used)) if used == data.len() => Ok(c),
        Some((Frame::CacheEvents(_), _)) => Err(invalid("bytes after the CACHE_EVENTS frame")),
        Some((other, _)) => Err(invalid(format!(
            "expected a CACHE_EVENTS frame, got {}",
            other.kind()
        ))),
        None => Err(invalid("incomplete frame")),
    }
}

/// Membership-only index of what each decode instance caches, built from their
/// CACHE_EVENTS frames: the prefill side's view of its decoders.
#[pyclass(frozen, module = "pdd_transport._native")]
pub struct PrefixMirror {
    mirror: Mutex<Mirror>,
}

impl PrefixMirror {
    fn with<T>(&self, f: impl FnOnce(&mut Mirror) -> T) -> T {
        f(&mut self.mirror.lock().unwrap_or_else(|p| p.into_inner()))
    }
}

#[pymethods]
impl PrefixMirror {
    #[new]
    #[pyo3(signature = (page_size = 64))]
    fn new(page_size: usize) -> PyResult<Self> {
        Ok(PrefixMirror {
            mirror: Mutex::new(Mirror::new(page_size).map_err(PddErr)?),
        })
    }

    /// Apply one encoded CACHE_EVENTS frame; returns how many events were new.
    /// Raises `ProtocolError` (reason `cache_event_gap` / `cache_event_mismatch`) when
    /// the instance must be resynced from a snapshot; events before the bad one stay.
    fn apply_frame(&self, frame: &[u8]) -> PyResult<usize> {
        let events = frame_events(frame)?;
        self.with(|m| m.apply_frame(&events))
            .map_err(|e| PddErr(e).into())
    }

    /// Replace what is known of `instance` with a snapshot (`RadixCache.snapshot_frames`).
    fn resync(&self, instance: u64, last_event_id: u64, frames: Vec<Vec<u8>>) -> PyResult<()> {
        let mut stored = Vec::new();
        for f in &frames {
            for e in frame_events(f)?.events {
                match e {
                    wire::CacheEvent::Stored {
                        parent,
                        page_hashes,
                    } => stored.push(StoredPages {
                        parent,
                        page_hashes,
                    }),
                    _ => return Err(invalid("a snapshot holds only stored events")),
                }
            }
        }
        let snap = Snapshot {
            last_event_id,
            stored,
        };
        self.with(|m| m.resync(instance, &snap))
            .map_err(|e| PddErr(e).into())
    }

    /// Forget an instance (it restarted or left).
    fn remove_instance(&self, instance: u64) -> bool {
        self.with(|m| m.remove_instance(instance))
    }

    /// Known instances.
    fn instances(&self) -> Vec<u64> {
        self.with(|m| m.instances())
    }

    /// Last event id applied for `instance` (None if unknown).
    fn last_event_id(&self, instance: u64) -> Option<u64> {
        self.with(|m| m.last_event_id(instance))
    }

    /// Pages matched per instance: `{instance: matched_pages}` for every instance.
    #[pyo3(signature = (tokens, namespace = 0))]
    fn match_prefix<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
        namespace: u64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let t = Tokens::extract(tokens, "tokens")?;
        let s = t.slice();
        let matches = if s.len() >= DETACH_TOKENS {
            py.detach(|| self.with(|m| m.match_prefix(namespace, s)))
        } else {
            self.with(|m| m.match_prefix(namespace, s))
        };
        let d = PyDict::new(py);
        for m in matches {
            d.set_item(m.instance, m.matched_pages)?;
        }
        Ok(d)
    }
}

/// Chain hashes of every whole page of `tokens` in `namespace` (uint64 array): the
/// hash of page `i` covers pages `0..=i`. The last one is a prefix's `prefix_hash`.
#[pyfunction]
#[pyo3(signature = (tokens, page_size, namespace = 0))]
fn chain_hashes<'py>(
    py: Python<'py>,
    tokens: &Bound<'py, PyAny>,
    page_size: usize,
    namespace: u64,
) -> PyResult<Bound<'py, PyArray1<u64>>> {
    if page_size == 0 || page_size > 256 {
        return Err(invalid(format!("page_size {page_size} outside 1..=256")));
    }
    let t = Tokens::extract(tokens, "tokens")?;
    let out = hash::chain_hashes(hash::root_seed(namespace), t.slice(), page_size);
    Ok(PyArray1::from_vec(py, out))
}
