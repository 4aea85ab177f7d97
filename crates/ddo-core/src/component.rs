//! [`Component`]: one model of a pipeline as a tree of named modules whose leaves own the
//! weights, plus the program that runs it, its mode, its ownership flag, and the slot its
//! attached route's hooks live in.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::{Mutex, RwLock};

use crate::device::{Device, Stream};
use crate::error::{CoreError, Result};
use crate::param::{Param, ParamId};
use crate::route::{AttachedRoute, ComponentProgram, ForwardContext};
use crate::tensor::Tensor;

/// What a leaf computes, as far as routes care.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LeafKind {
    /// A dense linear layer.
    Linear,
    /// A 2-D convolution.
    Conv2d,
    /// A normalisation layer (group, layer, RMS).
    Norm,
    /// An embedding table.
    Embedding,
    /// Anything else that owns weights.
    Other,
}

/// What a module is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ModuleKind {
    /// A leaf: owns params, runs as one unit, has no children.
    Leaf(LeafKind),
    /// A plain container of children.
    Container,
    /// A list of repeated blocks (a `ModuleList`/`Sequential`): block-level offload
    /// groups its direct children.
    BlockList,
}

/// A module of a component tree, as built by model code.
#[derive(Clone)]
pub struct Module {
    name: String,
    kind: ModuleKind,
    params: Vec<(String, Arc<Param>)>,
    children: Vec<Module>,
}

impl Module {
    /// A leaf with its params (local names).
    pub fn leaf(
        name: impl Into<String>,
        kind: LeafKind,
        params: Vec<(String, Arc<Param>)>,
    ) -> Self {
        Self {
            name: name.into(),
            kind: ModuleKind::Leaf(kind),
            params,
            children: Vec::new(),
        }
    }

    /// A container of children.
    pub fn container(name: impl Into<String>, children: Vec<Module>) -> Self {
        Self {
            name: name.into(),
            kind: ModuleKind::Container,
            params: Vec::new(),
            children,
        }
    }

    /// A list of repeated blocks.
    pub fn block_list(name: impl Into<String>, blocks: Vec<Module>) -> Self {
        Self {
            name: name.into(),
            kind: ModuleKind::BlockList,
            params: Vec::new(),
            children: blocks,
        }
    }

    /// The module's own name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its kind.
    pub fn kind(&self) -> ModuleKind {
        self.kind
    }

    /// Its children.
    pub fn children(&self) -> &[Module] {
        &self.children
    }
}

/// Index of a leaf in its component's leaf table (depth-first order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeafId(pub usize);

/// Where a leaf sits relative to the root's block lists (what block-level offload groups).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Inside block `index` of the root's block list `list`.
    Block {
        /// Name of the block list (a direct child of the root).
        list: String,
        /// Block index in the list.
        index: usize,
    },
    /// Anywhere else.
    Unmatched,
}

/// A leaf of a component, with its full path.
#[derive(Debug, Clone)]
pub struct Leaf {
    id: LeafId,
    path: String,
    kind: LeafKind,
    params: Vec<(String, Arc<Param>)>,
    placement: Placement,
}

impl Leaf {
    /// Its id.
    pub fn id(&self) -> LeafId {
        self.id
    }

    /// Dotted path from the root (`blocks.0.attn.to_q`).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Its kind.
    pub fn kind(&self) -> LeafKind {
        self.kind
    }

    /// Params with local names.
    pub fn params(&self) -> &[(String, Arc<Param>)] {
        &self.params
    }

    /// Where it sits relative to the root's block lists.
    pub fn placement(&self) -> &Placement {
        &self.placement
    }

    /// Bytes of its params (a param held twice by one leaf counts once).
    pub fn param_bytes(&self) -> u64 {
        let mut seen = HashSet::new();
        self.params
            .iter()
            .filter(|(_, p)| seen.insert(p.id()))
            .map(|(_, p)| p.nbytes() as u64)
            .sum()
    }
}

/// Evaluation or training mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Inference.
    Eval,
    /// Training.
    Train,
}

/// One model of a pipeline.
pub struct Component {
    name: String,
    class_name: String,
    root: Module,
    leaves: Vec<Leaf>,
    program: Arc<dyn ComponentProgram>,
    mode: RwLock<Mode>,
    exclusive: AtomicBool,
    attached: Mutex<Option<Arc<dyn AttachedRoute>>>,
    forward_lock: Mutex<()>,
    /// Low-rank adapters by leaf ([`crate::adapter`]): resident beside the route's weights,
    /// never part of them.
    adapters: RwLock<crate::adapter::AdapterSet>,
    /// Whether a route that holds the weights on the device for good folds the adapters
    /// into them ([`Component::set_adapter_fusion`]).
    fuse_adapters: AtomicBool,
    /// Whether linears with E4M3 weights run in fp8 ([`Component::set_fp8_compute`]).
    fp8_compute: AtomicBool,
    /// Whether each fp8 linear reads its input's finite check at the call
    /// ([`Component::set_fp8_checks`]).
    fp8_checks: AtomicBool,
}

impl Component {
    /// Builds a component from its module tree and program. Params live on leaves only
    /// (a module-level weight is modelled as a leaf of kind `Other`); leaf paths must be
    /// unique. Starts in eval mode, not marked exclusively owned.
    pub fn new(
        name: impl Into<String>,
        class_name: impl Into<String>,
        root: Module,
        program: Arc<dyn ComponentProgram>,
    ) -> Result<Arc<Self>> {
        let name = name.into();
        let mut leaves = Vec::new();
        let mut paths = HashSet::new();
        for child in &root.children {
            let placement_root = match child.kind {
                ModuleKind::BlockList => Some(child.name.clone()),
                _ => None,
            };
            collect_leaves(
                child,
                &child.name,
                placement_root.as_deref(),
                None,
                &mut leaves,
                &mut paths,
                &name,
            )?;
        }
        if !root.params.is_empty() || matches!(root.kind, ModuleKind::Leaf(_)) {
            return Err(CoreError::InvalidOption {
                option: "component root".into(),
                value: root.name.clone(),
                hint: "the root must be a container; put its weights in a leaf of kind Other"
                    .into(),
            });
        }
        Ok(Arc::new(Self {
            name,
            class_name: class_name.into(),
            root,
            leaves,
            program,
            mode: RwLock::new(Mode::Eval),
            exclusive: AtomicBool::new(false),
            attached: Mutex::new(None),
            forward_lock: Mutex::new(()),
            adapters: RwLock::new(Default::default()),
            fuse_adapters: AtomicBool::new(false),
            fp8_compute: AtomicBool::new(false),
            fp8_checks: AtomicBool::new(false),
        }))
    }

    /// The component's name in its pipeline (`vae`, `transformer`, ...).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The model class (`AutoencoderKL`, ...). Informational: routing never looks at it.
    pub fn class_name(&self) -> &str {
        &self.class_name
    }

    /// The module tree.
    pub fn root(&self) -> &Module {
        &self.root
    }

    /// Leaves in depth-first order.
    pub fn leaves(&self) -> &[Leaf] {
        &self.leaves
    }

    /// One leaf.
    pub fn leaf(&self, id: LeafId) -> Result<&Leaf> {
        self.leaves.get(id.0).ok_or_else(|| CoreError::Shape {
            what: format!("component `{}`", self.name),
            message: format!("no leaf with id {}", id.0),
        })
    }

    /// A leaf by path.
    pub fn leaf_by_path(&self, path: &str) -> Option<&Leaf> {
        self.leaves.iter().find(|l| l.path == path)
    }

    /// Replaces the component's low-rank adapters ([`crate::adapter`]): from the next
    /// forward on, each linear leaf in `adapters` adds them to its output. An empty set
    /// removes every adapter. The leaves' params are not touched, so the route attached
    /// (whatever it streams, pins or keeps resident) needs no change. A forward running on
    /// another thread finishes with the adapters it started with: the change waits for it
    /// (never call this from inside a forward of the same component).
    pub fn set_adapters(&self, adapters: crate::adapter::AdapterSet) -> Result<()> {
        for id in adapters.keys() {
            self.leaf(*id)?;
        }
        if let Some(h) = self.attached().filter(|h| h.folds_adapters()) {
            return Err(CoreError::InvalidOption {
                option: "adapters".into(),
                value: self.name.clone(),
                hint: format!(
                    "the `{}` route folded this component's LoRA into its weights; detach it (or \
                     leave --lora-fuse off) to change LoRAs",
                    h.route_name()
                ),
            });
        }
        let _between_forwards = self.forward_lock.lock();
        *self.adapters.write() = adapters;
        Ok(())
    }

    /// Asks a route that keeps the weights on the device for good (`none`) to fold the
    /// adapters into them when it attaches (`--lora-fuse`): no cost per forward, and the
    /// weights on the host untouched (a detach drops the folded copy; the next attach
    /// uploads the original and folds again). Routes that stream add the adapters as usual.
    pub fn set_adapter_fusion(&self, fuse: bool) {
        self.fuse_adapters.store(fuse, Ordering::Release);
    }

    /// Whether [`Component::set_adapter_fusion`] asked for folding.
    pub fn fuses_adapters(&self) -> bool {
        self.fuse_adapters.load(Ordering::Acquire)
    }

    /// Makes the component's linears whose weights are E4M3 codes run in fp8
    /// ([`crate::Ops::linear_fp8`]: `--compute fp8`) instead of upcasting the weight to the
    /// input's dtype. Other linears are unchanged.
    pub fn set_fp8_compute(&self, fp8: bool) {
        self.fp8_compute.store(fp8, Ordering::Release);
    }

    /// Whether [`Component::set_fp8_compute`] asked for fp8 linears.
    pub fn fp8_compute(&self) -> bool {
        self.fp8_compute.load(Ordering::Acquire)
    }

    /// Makes each fp8 linear count its input's NaN and Inf values and read the count before
    /// it runs, so that a non-finite input stops the forward with
    /// [`crate::CoreError::NonFiniteActivation`] naming the layer. A device's fp8 GEMM does
    /// not read it (that would hold the host at every linear: a NaN makes the product NaN
    /// and the step's finite check stops the run); a pipeline turns this on only to run
    /// again the forward whose output held a NaN, to name the layer where it began.
    pub fn set_fp8_checks(&self, on: bool) {
        self.fp8_checks.store(on, Ordering::Release);
    }

    /// Whether [`Component::set_fp8_checks`] turned the checks at the call on.
    pub fn fp8_checks(&self) -> bool {
        self.fp8_checks.load(Ordering::Acquire)
    }

    /// The adapters of leaf `id` (`None`: none).
    pub fn adapters_of(&self, id: LeafId) -> Option<Arc<[crate::adapter::Adapter]>> {
        self.adapters.read().get(&id).cloned()
    }

    /// Device bytes of the component's adapters.
    pub fn adapter_bytes(&self) -> u64 {
        let adapters = self.adapters.read();
        // A factor several adapters share (one fused module's `A`) counts once.
        let mut seen: Vec<&Tensor> = Vec::new();
        let mut total = 0;
        for a in adapters.values().flat_map(|a| a.iter()) {
            for t in [&a.down, &a.up] {
                if !seen.iter().any(|s| s.same_view(t)) {
                    seen.push(t);
                    total += t.nbytes() as u64;
                }
            }
        }
        total
    }

    /// Every param once (tied weights once), in first-use order.
    pub fn params(&self) -> Vec<Arc<Param>> {
        let mut seen = HashSet::new();
        self.leaves
            .iter()
            .flat_map(|l| l.params.iter())
            .filter(|(_, p)| seen.insert(p.id()))
            .map(|(_, p)| Arc::clone(p))
            .collect()
    }

    /// The checkpoint files its params are mapped from (file mappings only, not weights made
    /// in memory; coded tensors' files included), each once, in path order: what its weights
    /// are read from.
    pub fn mapped_files(&self) -> Vec<Arc<crate::host_memory::CheckpointMap>> {
        let mut files: Vec<Arc<crate::host_memory::CheckpointMap>> = Vec::new();
        for p in self.params() {
            let host = p.host();
            // A coded tensor's file is read as much as a mapped one's.
            if let Some((map, _)) = host.file_range()
                && map.is_file()
                && !files.iter().any(|f| Arc::ptr_eq(f, map))
            {
                files.push(Arc::clone(map));
            }
        }
        files.sort_by(|a, b| a.path().cmp(b.path()));
        files
    }

    /// Every registered name of every param (`leaf.path` + `.` + local name).
    pub fn named_params(&self) -> Vec<(String, Arc<Param>)> {
        self.leaves
            .iter()
            .flat_map(|l| {
                l.params
                    .iter()
                    .map(move |(n, p)| (format!("{}.{n}", l.path), Arc::clone(p)))
            })
            .collect()
    }

    /// Params registered under more than one name (exact aliases), with their names.
    pub fn aliases(&self) -> BTreeMap<ParamId, Vec<String>> {
        let mut names: BTreeMap<ParamId, Vec<String>> = BTreeMap::new();
        for (n, p) in self.named_params() {
            names.entry(p.id()).or_default().push(n);
        }
        names.retain(|_, v| v.len() > 1);
        names
    }

    /// Bytes of all params (tied weights once).
    pub fn param_bytes(&self) -> u64 {
        self.params().iter().map(|p| p.nbytes() as u64).sum()
    }

    /// Bytes of the largest leaf.
    pub fn largest_leaf(&self) -> Option<&Leaf> {
        self.leaves.iter().max_by_key(|l| l.param_bytes())
    }

    /// Evaluation or training mode.
    pub fn mode(&self) -> Mode {
        *self.mode.read()
    }

    /// Switches to evaluation mode.
    pub fn eval(&self) {
        *self.mode.write() = Mode::Eval;
    }

    /// Switches to training mode.
    pub fn train(&self) {
        *self.mode.write() = Mode::Train;
    }

    /// Whether the caller has declared that no code outside the component holds its tensors.
    pub fn exclusively_owned(&self) -> bool {
        self.exclusive.load(Ordering::Acquire)
    }

    /// Declares (or withdraws) exclusive ownership of the component's tensors.
    pub fn set_exclusively_owned(&self, exclusive: bool) {
        self.exclusive.store(exclusive, Ordering::Release);
    }

    /// The attached route's hooks, if any.
    pub fn attached(&self) -> Option<Arc<dyn AttachedRoute>> {
        self.attached.lock().clone()
    }

    /// Installs a route's hooks; refuses when another route is attached.
    pub fn install_hooks(&self, hooks: Arc<dyn AttachedRoute>) -> Result<()> {
        let mut slot = self.attached.lock();
        if let Some(existing) = slot.as_ref() {
            return Err(CoreError::AlreadyAttached {
                component: self.name.clone(),
                route: existing.route_name(),
            });
        }
        *slot = Some(hooks);
        Ok(())
    }

    /// Removes `hooks` if they are the ones installed; returns whether they were. Removes
    /// nothing else.
    pub fn remove_hooks(&self, hooks: &Arc<dyn AttachedRoute>) -> bool {
        let mut slot = self.attached.lock();
        match slot.as_ref() {
            Some(current) if Arc::ptr_eq(current, hooks) => {
                *slot = None;
                true
            }
            _ => false,
        }
    }

    /// Runs the component's program on `device`, through the attached route's hooks.
    pub fn forward(&self, device: &dyn Device, input: Tensor) -> Result<Tensor> {
        self.run(device, |ctx| self.program.forward(ctx, input))
    }

    /// Runs `body` as one forward of this component on `device`: the attached route's
    /// `before_forward`, then `body` (which runs leaves through
    /// [`ForwardContext::run_leaf`]), then `after_forward`. Models with several inputs
    /// (the Flux transformer) call this with their own typed forward.
    pub fn run<T>(
        &self,
        device: &dyn Device,
        body: impl FnOnce(&mut ForwardContext<'_>) -> Result<T>,
    ) -> Result<T> {
        let _one_forward_at_a_time = self.forward_lock.lock();
        let hooks = self.attached();
        if let Some(h) = &hooks {
            if h.device_id() != device.id() {
                return Err(CoreError::WrongDevice {
                    what: "execution device",
                    expected: h.device_id().to_string(),
                    found: device.id().to_string(),
                });
            }
            h.metrics().record_forward();
            h.before_forward()?;
        }
        let mut ctx = ForwardContext::new(self, device, hooks.as_deref());
        let out = body(&mut ctx);
        // What the backend kept for this forward goes, whether it succeeded or not.
        let ended = device.ops().map_or(Ok(()), |o| o.end_forward());
        let out = out?;
        ended?;
        if let Some(h) = &hooks {
            h.after_forward()?;
        }
        Ok(out)
    }

    /// Moves every param to `device` outside any route (what `pipe.to(device)` does for
    /// an unmanaged component). Refused while a route is attached.
    pub fn to_device(&self, device: &dyn Device, stream: &Stream) -> Result<()> {
        if let Some(h) = self.attached() {
            return Err(CoreError::AlreadyAttached {
                component: self.name.clone(),
                route: h.route_name(),
            });
        }
        let mut moved = Vec::new();
        for p in self.params() {
            if p.device().is_some() {
                continue;
            }
            let placed = device.alloc(p.nbytes()).and_then(|buf| {
                device.copy_h2d(&p.host(), &buf.slice_all(), stream)?;
                p.set_device(Some(buf.slice_all()))
            });
            match placed {
                Ok(_) => moved.push(p),
                Err(e) => {
                    for q in moved {
                        let _ = q.set_device(None);
                    }
                    return Err(e);
                }
            }
        }
        device.synchronize_stream(stream)
    }

    /// Drops every param's device copy outside any route. Refused while a route is attached.
    pub fn to_host(&self) -> Result<()> {
        if let Some(h) = self.attached() {
            return Err(CoreError::AlreadyAttached {
                component: self.name.clone(),
                route: h.route_name(),
            });
        }
        for p in self.params() {
            p.set_device(None)?;
        }
        Ok(())
    }
}

impl fmt::Debug for Component {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Component")
            .field("name", &self.name)
            .field("class_name", &self.class_name)
            .field("leaves", &self.leaves.len())
            .field("param_bytes", &self.param_bytes())
            .field("mode", &self.mode())
            .finish()
    }
}

fn collect_leaves(
    module: &Module,
    path: &str,
    block_list: Option<&str>,
    block_index: Option<usize>,
    out: &mut Vec<Leaf>,
    paths: &mut HashSet<String>,
    component: &str,
) -> Result<()> {
    let invalid = |hint: &str| CoreError::InvalidOption {
        option: format!("module `{path}` of component `{component}`"),
        value: format!("{:?}", module.kind),
        hint: hint.to_string(),
    };
    match module.kind {
        ModuleKind::Leaf(kind) => {
            if !module.children.is_empty() {
                return Err(invalid("a leaf has no children"));
            }
            if !paths.insert(path.to_string()) {
                return Err(invalid("leaf paths must be unique"));
            }
            let mut local = HashSet::new();
            if let Some((dup, _)) = module.params.iter().find(|(n, _)| !local.insert(n.clone())) {
                return Err(CoreError::InvalidOption {
                    option: format!("leaf `{path}`"),
                    value: dup.clone(),
                    hint: "local param names must be unique within a leaf".into(),
                });
            }
            let placement = match (block_list, block_index) {
                (Some(list), Some(index)) => Placement::Block {
                    list: list.to_string(),
                    index,
                },
                _ => Placement::Unmatched,
            };
            out.push(Leaf {
                id: LeafId(out.len()),
                path: path.to_string(),
                kind,
                params: module.params.clone(),
                placement,
            });
        }
        ModuleKind::Container | ModuleKind::BlockList => {
            if !module.params.is_empty() {
                return Err(invalid(
                    "params live on leaves; model a module-level weight as a leaf of kind Other",
                ));
            }
            for (i, child) in module.children.iter().enumerate() {
                let child_path = format!("{path}.{}", child.name);
                // Direct children of a root-level block list are its blocks.
                let index = if block_list.is_some() && block_index.is_none() {
                    Some(i)
                } else {
                    block_index
                };
                collect_leaves(child, &child_path, block_list, index, out, paths, component)?;
            }
        }
    }
    Ok(())
}
