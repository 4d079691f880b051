"""Smoke test of an installed grpo_ext wheel (run outside the source tree): import, build_info(), ops on the CPU."""

import json
import sys

import torch

import grpo_ext

info = grpo_ext.build_info()
print(json.dumps(info))
# The wheel in this environment, not the build venv's editable install.
assert grpo_ext.__file__.startswith(sys.prefix), (grpo_ext.__file__, sys.prefix)
assert info["torch_runtime_version"] == torch.__version__, info
assert all(path.startswith(sys.prefix) for path in info["libraries"]), info["libraries"]
rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
adv = grpo_ext.group_advantages(rewards, 4).advantages
expected = grpo_ext.reference.group_advantages(rewards.double(), 4).advantages
torch.testing.assert_close(adv.double(), expected, rtol=1e-6, atol=1e-6)
logps = torch.full((4, 3), -1.0, requires_grad=True)
out = grpo_ext.grpo_loss(logps, adv, torch.ones(4, 3))
out.loss.backward()
assert abs(out.loss.item()) < 1e-6 and logps.grad.abs().sum() > 0
if torch.version.cuda and info["cuda_compiled"]:
    assert info["cuda_kernels_registered"], "CUDA kernels compiled but not registered"
print("wheel smoke test passed")
