"""Datasheet lookup by the names torch reports, and MFU arithmetic."""

import pytest

from turbotrain.parts.hardware import DeviceSpec, estimate_mfu, lookup_peak, precision_key


@pytest.mark.parametrize(
    "name, expected, bf16, bandwidth",
    [
        ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM", 989, 3350),
        ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe", 756, 2000),
        ("NVIDIA H200", "NVIDIA H200 SXM", 989, 4800),
        ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB SXM", 312, 2039),
        ("NVIDIA A100-SXM4-40GB", "NVIDIA A100 40GB SXM", 312, 1555),
        ("NVIDIA A100 80GB PCIe", "NVIDIA A100 80GB PCIe", 312, 1935),
        ("NVIDIA A100-PCIE-40GB", "NVIDIA A100 40GB PCIe", 312, 1555),
        ("NVIDIA L4", "NVIDIA L4", 121, 300),
        ("NVIDIA L40S", "NVIDIA L40S", 362, 864),
        ("NVIDIA GeForce RTX 3090", "NVIDIA GeForce RTX 3090", 71, 936),
        ("NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 4090", 165.2, 1008),
    ],
)
def test_names_as_torch_reports_them_map_to_the_right_variant(name, expected, bf16, bandwidth):
    spec = lookup_peak(name)
    assert spec is not None and spec.name == expected
    assert spec.peak_tflops("bf16-mixed") == bf16 and spec.mem_bandwidth_gbs == bandwidth


def test_volta_has_no_bf16_peak_but_an_fp16_one():
    spec = lookup_peak("Tesla V100-SXM2-16GB")
    assert spec.peak_tflops("bf16") is None and spec.peak_tflops("fp16-mixed") == 125
    assert lookup_peak("Tesla V100-PCIE-32GB").peak_tflops("fp16") == 112


@pytest.mark.parametrize("name", ["cpu", "", None, "NVIDIA A10G", "AMD Instinct MI300X", "NVIDIA A1000"])
def test_unknown_devices_give_none_not_an_error(name):
    assert lookup_peak(name) is None


def test_estimate_mfu_is_a_fraction_of_the_dense_peak():
    h200 = lookup_peak("NVIDIA H200")
    assert estimate_mfu(494.5e12, h200) == pytest.approx(0.5)
    assert estimate_mfu(494.5e12, 989.0) == pytest.approx(0.5)
    assert estimate_mfu(33.5e12, h200, precision="fp32") == pytest.approx(0.5)
    with pytest.raises(ValueError, match="no usable peak"):
        estimate_mfu(1e12, lookup_peak("Tesla V100-SXM2-16GB"), precision="bf16")


def test_precision_names_map_to_peak_keys():
    assert [
        precision_key(p) for p in ("bf16-mixed", "bf16-true", "fp16-mixed", "torch.float16", "tf32", "fp32")
    ] == ["bf16", "bf16", "fp16", "fp16", "tf32", "fp32"]
    with pytest.raises(ValueError):
        precision_key("int4")
    assert isinstance(lookup_peak("NVIDIA H100 NVL"), DeviceSpec)
