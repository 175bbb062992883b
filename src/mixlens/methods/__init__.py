"""Attribution methods; importing this package fills the registry."""

from mixlens.methods import (  # noqa: F401  (registration side effects)
    alti,
    alti_logit,
    attention,
    attnlrp,
    decompx,
    decompx_logit,
    flow_routes,
    globenc,
    gradients,
    norm_rollouts,
    norms,
    perturbation,
    rollout,
    saliency,
    value_zeroing,
)
from mixlens.methods.registry import REGISTRY, Method, MethodOutput, Option, check_options, get, names, register

__all__ = ["REGISTRY", "Method", "MethodOutput", "Option", "check_options", "get", "names", "register"]
