//! [`ModelBuilder`]: builds a component's module tree while asking a [`WeightSource`] for
//! each param by its Diffusers/Transformers name, and hands out the [`LeafId`]s model code
//! runs its layers with.

use std::sync::Arc;

use ddo_core::{Component, ComponentProgram, LeafId, LeafKind, Module, Param, ParamKind};

use crate::error::{LoadError, LoadResult};
use crate::weights::WeightSource;

enum FrameKind {
    Container,
    BlockList,
}

struct Frame {
    name: String,
    kind: FrameKind,
    children: Vec<Module>,
}

/// Builds a module tree in depth-first order. Leaf ids are assigned in creation order,
/// which is the order `Component::new` flattens the tree in; `finish` checks they agree.
pub struct ModelBuilder<'w> {
    weights: &'w mut dyn WeightSource,
    stack: Vec<Frame>,
    leaf_paths: Vec<String>,
}

impl<'w> ModelBuilder<'w> {
    /// A builder that takes params from `weights`.
    pub fn new(weights: &'w mut dyn WeightSource) -> Self {
        Self {
            weights,
            stack: vec![Frame {
                name: String::new(),
                kind: FrameKind::Container,
                children: Vec::new(),
            }],
            leaf_paths: Vec::new(),
        }
    }

    /// Enters a child container `name`.
    pub fn enter(&mut self, name: impl Into<String>) {
        self.stack.push(Frame {
            name: name.into(),
            kind: FrameKind::Container,
            children: Vec::new(),
        });
    }

    /// Enters a block list `name` (a `ModuleList` of repeated blocks).
    pub fn enter_blocks(&mut self, name: impl Into<String>) {
        self.stack.push(Frame {
            name: name.into(),
            kind: FrameKind::BlockList,
            children: Vec::new(),
        });
    }

    /// Leaves the current container or block list.
    pub fn exit(&mut self) {
        if self.stack.len() > 1
            && let Some(frame) = self.stack.pop()
        {
            let module = match frame.kind {
                FrameKind::Container => Module::container(frame.name, frame.children),
                FrameKind::BlockList => Module::block_list(frame.name, frame.children),
            };
            if let Some(parent) = self.stack.last_mut() {
                parent.children.push(module);
            }
        }
    }

    /// Runs `f` inside child container `name`.
    pub fn scope<T>(
        &mut self,
        name: impl Into<String>,
        f: impl FnOnce(&mut Self) -> LoadResult<T>,
    ) -> LoadResult<T> {
        self.enter(name);
        let out = f(self);
        self.exit();
        out
    }

    /// The dotted path of `name` under the current position.
    pub fn path(&self, name: &str) -> String {
        let mut parts: Vec<&str> = self.stack.iter().skip(1).map(|f| f.name.as_str()).collect();
        parts.push(name);
        parts.join(".")
    }

    /// Creates leaf `name` whose params (local name, shape) are loaded as
    /// `<path>.<name>.<local>`.
    pub fn leaf(
        &mut self,
        name: &str,
        kind: LeafKind,
        params: &[(&str, &[usize])],
    ) -> LoadResult<LeafId> {
        let path = self.path(name);
        let mut loaded: Vec<(String, Arc<Param>)> = Vec::with_capacity(params.len());
        for (local, shape) in params {
            let full = format!("{path}.{local}");
            let p = self.weights.param(&full, shape, ParamKind::Parameter)?;
            loaded.push(((*local).to_string(), p));
        }
        self.push_leaf(name, kind, path, loaded)
    }

    /// Creates leaf `name` from params already loaded (tied weights).
    pub fn leaf_with(
        &mut self,
        name: &str,
        kind: LeafKind,
        params: Vec<(String, Arc<Param>)>,
    ) -> LoadResult<LeafId> {
        let path = self.path(name);
        self.push_leaf(name, kind, path, params)
    }

    /// The weight source, for params a model loads by hand.
    pub fn weights(&mut self) -> &mut dyn WeightSource {
        self.weights
    }

    fn push_leaf(
        &mut self,
        name: &str,
        kind: LeafKind,
        path: String,
        params: Vec<(String, Arc<Param>)>,
    ) -> LoadResult<LeafId> {
        // fp8 is computed on only in linears (on every backend, so a checkpoint that runs
        // in CI runs on CUDA): anywhere else it is refused before anything is attached.
        if kind != LeafKind::Linear
            && let Some((local, p)) = params.iter().find(|(_, p)| p.dtype().is_fp8())
        {
            return Err(LoadError::Fp8OutsideLinear {
                name: p
                    .source()
                    .map_or_else(|| format!("{path}.{local}"), |s| s.tensor.clone()),
                dtype: p.dtype().to_string(),
                kind: format!("{kind:?}").to_lowercase(),
            });
        }
        let id = LeafId(self.leaf_paths.len());
        self.leaf_paths.push(path);
        if let Some(frame) = self.stack.last_mut() {
            frame.children.push(Module::leaf(name, kind, params));
        }
        Ok(id)
    }

    /// Builds the component; checks that every leaf id names the leaf it was made for.
    pub fn finish(
        mut self,
        component: &str,
        class_name: &str,
        program: Arc<dyn ComponentProgram>,
    ) -> LoadResult<Arc<Component>> {
        while self.stack.len() > 1 {
            self.exit();
        }
        let root = self.stack.pop().map(|f| f.children).unwrap_or_default();
        let c = Component::new(component, class_name, Module::container("", root), program)?;
        for (i, path) in self.leaf_paths.iter().enumerate() {
            let actual = c.leaf(LeafId(i))?.path();
            if actual != path {
                return Err(LoadError::InvalidConfig {
                    field: "module tree".into(),
                    value: path.clone(),
                    hint: format!(
                        "leaf {i} was built as `{path}` but the tree orders `{actual}` there; \
                         build leaves in depth-first order"
                    ),
                });
            }
        }
        Ok(c)
    }
}
