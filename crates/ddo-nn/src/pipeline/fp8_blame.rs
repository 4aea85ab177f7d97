//! Naming the layer where a NaN or an Inf began under `--compute fp8` (issue 39).
//!
//! The host reference reads every fp8 linear's input and stops at the first non-finite one,
//! naming it ([`CoreError::NonFiniteActivation`]). A device's fp8 GEMM does not read it: that
//! would hold the host at every linear. There a non-finite input makes the product NaN, and
//! the finite check after the step (or after an encoder) stops the run,
//! [`CoreError::NonFinite`], naming only the step. Then the forward that produced it runs
//! once more with the checks at the call on ([`Component::set_fp8_checks`]): its first fp8
//! linear with a non-finite input names itself. A forward costs one step, paid only on the
//! way out of a failed run; nothing is written either way.

use std::collections::VecDeque;

use ddo_core::{Component, CoreError, Result, Tensor};

/// `err`, or, where it is a [`CoreError::NonFinite`], `component` computes in fp8 and
/// running `again` with the checks at the call on stops at an fp8 linear, that layer's
/// [`CoreError::NonFiniteActivation`]. Any other outcome of `again` (it ran clean: the NaN
/// began outside the fp8 linears; another error) leaves `err` as it is.
pub(crate) fn name_fp8_layer<T>(
    component: &Component,
    err: CoreError,
    again: impl FnOnce() -> Result<T>,
) -> CoreError {
    if !component.fp8_compute() || !matches!(err, CoreError::NonFinite { .. }) {
        return err;
    }
    /// Turns the checks off again however the forward ends (a panic included).
    struct Checks<'c>(&'c Component);
    impl Drop for Checks<'_> {
        fn drop(&mut self) {
            self.0.set_fp8_checks(false);
        }
    }
    component.set_fp8_checks(true);
    let checks = Checks(component);
    let found = again();
    drop(checks);
    match found {
        Err(named @ CoreError::NonFiniteActivation { .. }) => named,
        _ => err,
    }
}

/// The latents the last two denoising steps started from, kept while the transformer
/// computes in fp8: a step's finite check is read one step late
/// ([`ddo_core::DeferredFiniteChecks`]), and the step it names must be run again from its
/// own input to name the layer ([`name_fp8_layer`]). Holds nothing otherwise.
pub(crate) struct StepInputs<'c> {
    component: &'c Component,
    kept: VecDeque<(usize, Tensor)>,
}

impl<'c> StepInputs<'c> {
    /// None kept yet, for the transformer `component`.
    pub(crate) fn new(component: &'c Component) -> Self {
        Self {
            component,
            kept: VecDeque::with_capacity(2),
        }
    }

    /// Keeps `latents` as step `index`'s input (from 0) when the transformer computes in
    /// fp8, dropping the oldest past two.
    pub(crate) fn keep(&mut self, index: usize, latents: &Tensor) {
        if self.component.fp8_compute() {
            if self.kept.len() == 2 {
                self.kept.pop_front();
            }
            self.kept.push_back((index, latents.clone()));
        }
    }

    /// `err`, or the fp8 layer that running again (`again`: the step's forward from its
    /// input latents and its index) names, where `err` is the finite check of a step whose
    /// input is kept.
    pub(crate) fn name(
        &self,
        err: CoreError,
        again: impl FnOnce(&Tensor, usize) -> Result<()>,
    ) -> CoreError {
        let CoreError::NonFinite {
            step: Some((step, _)),
            ..
        } = &err
        else {
            return err;
        };
        let Some((index, latents)) = self.kept.iter().find(|(i, _)| i + 1 == *step) else {
            return err;
        };
        let index = *index;
        name_fp8_layer(self.component, err, || again(latents, index))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ddo_core::DType;

    fn component() -> std::sync::Arc<Component> {
        let spec = ddo_core::reference::ReferenceSpec::small("transformer", 1, 4, DType::F32);
        ddo_core::reference::build(&spec).expect("a reference component")
    }

    fn non_finite(step: usize) -> CoreError {
        CoreError::NonFinite {
            phase: "denoise".into(),
            step: Some((step, 4)),
            what: "the latents".into(),
            count: 1,
        }
    }

    #[test]
    fn a_step_runs_again_with_the_checks_on_only_under_fp8_and_only_for_a_nan() {
        let c = component();
        let named = || CoreError::NonFiniteActivation {
            layer: "transformer.proj".into(),
        };
        // Not computing in fp8: nothing runs again.
        let e = name_fp8_layer(&c, non_finite(1), || -> Result<()> { panic!("ran") });
        assert!(matches!(e, CoreError::NonFinite { .. }));
        c.set_fp8_compute(true);
        // Another error is left alone.
        let other = CoreError::Injected("x".into());
        let e = name_fp8_layer(&c, other, || -> Result<()> { panic!("ran") });
        assert!(matches!(e, CoreError::Injected(_)));
        // The checks are on while it runs again, and off after.
        let e = name_fp8_layer(&c, non_finite(1), || -> Result<()> {
            assert!(c.fp8_checks());
            Err(named())
        });
        assert!(!c.fp8_checks());
        assert!(
            matches!(e, CoreError::NonFiniteActivation { layer } if layer == "transformer.proj")
        );
        // A forward that panics leaves the checks off too.
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            name_fp8_layer(&c, non_finite(1), || -> Result<()> {
                panic!("a leaf panicked")
            })
        }));
        assert!(panicked.is_err());
        assert!(!c.fp8_checks(), "the checks stayed on after a panic");
        // Running clean (the NaN began outside the fp8 linears) keeps the step's error.
        let e = name_fp8_layer(&c, non_finite(2), || Ok(()));
        assert!(matches!(
            e,
            CoreError::NonFinite {
                step: Some((2, 4)),
                ..
            }
        ));
    }

    #[test]
    fn the_step_named_runs_again_from_its_own_input() {
        let c = component();
        let latents = |v: f32| Tensor::from_f32(vec![1], DType::F32, &[v]).expect("a host tensor");
        let mut kept = StepInputs::new(&c);
        kept.keep(0, &latents(0.0));
        assert!(kept.kept.is_empty(), "kept without fp8");
        c.set_fp8_compute(true);
        for i in 0..4 {
            kept.keep(i, &latents(i as f32));
        }
        assert_eq!(kept.kept.len(), 2);
        // Step 3 (from 1) started from index 2's latents.
        let e = kept.name(non_finite(3), |lat, index| {
            assert_eq!((lat.host_f32()?, index), (vec![2.0], 2));
            Err(CoreError::NonFiniteActivation {
                layer: "transformer.x".into(),
            })
        });
        assert!(matches!(e, CoreError::NonFiniteActivation { .. }));
        // A step no longer kept, or none named: the error as it was.
        let e = kept.name(non_finite(1), |_, _| panic!("ran"));
        assert!(matches!(
            e,
            CoreError::NonFinite {
                step: Some((1, 4)),
                ..
            }
        ));
    }
}
