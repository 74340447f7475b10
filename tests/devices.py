"""The device under test, for helpers that are not fixtures (server processes, module constants)."""

from __future__ import annotations

import os

import torch


def device_name_under_test() -> str:
    return os.environ.get("LINSERVE_TEST_DEVICE", "cpu")


def device_under_test() -> torch.device:
    return torch.device(device_name_under_test())
