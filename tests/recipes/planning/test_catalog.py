"""The hardware catalog: the packaged entries load and carry the seed document's figures, a user's YAML merges over
them field by field, and every bad name or value is refused with our error naming it."""

from __future__ import annotations

import pytest

from shardline.recipes.planning.catalog import (
    DEFAULT_CHANNELS,
    LINK_KINDS,
    PACKAGED_CATALOG,
    Cluster,
    PlanError,
    cluster,
    load_catalog,
)

GPUS = ("a100-40gb", "a100-80gb", "h100-sxm", "h200", "b200", "mi300x")
LINKS = ("pcie-gen4", "pcie-gen5", "nvlink3", "nvlink4", "nvlink5", "xgmi", "ib-hdr", "ib-ndr", "ib-xdr", "roce")


def _write(tmp_path, text: str):
    path = tmp_path / "site.yaml"
    path.write_text(text)
    return path


def test_every_packaged_gpu_link_and_cluster_builds():
    catalog = load_catalog()
    assert set(GPUS) <= set(catalog.gpus) and set(LINKS) <= set(catalog.links)
    for name in catalog.gpus:
        gpu = catalog.gpu(name)
        assert gpu.bf16_tflops > 0 and gpu.hbm_gb > 0 and 0 < gpu.matmul_fraction("bf16") <= 1
        assert catalog.link(gpu.intra_node).kind == "intra"
    for name in catalog.links:
        assert catalog.link(name).kind in LINK_KINDS
    for name in catalog.clusters:
        assert isinstance(catalog.cluster(name), Cluster)


def test_the_seed_documents_figures_per_direction():
    catalog = load_catalog()
    # Exact: these are the catalog's literal numbers (GB/s per direction).
    # The seed document says 64 GB/s, the raw 32 GT/s x 16 lanes; the catalog counts every PCIe generation after
    # the 128b/130b line code, as the PCI-SIG figures do (Gen4 31.5, Gen5 63.0).
    assert catalog.link("pcie-gen5").gbps == pytest.approx(32 * 16 * 128 / 130 / 8, abs=0.05) == 63.0
    assert catalog.link("nvlink4").gbps == 900 / 2  # seed: NVLink 4 900 GB/s bidirectional per GPU
    assert catalog.link("ib-ndr").gbps == 50  # seed: NDR 50-100 GB/s per port; we take 50 per direction
    assert catalog.gpu("h100-sxm").bf16_tflops == 989.5 and catalog.gpu("h100-sxm").fp8_tflops == 1979
    assert catalog.gpu("a100-80gb").fp8_tflops is None


def test_a_node_type_is_what_its_entry_names():
    dgx = load_catalog().cluster("dgx-a100-80gb")
    assert (dgx.gpu.name, dgx.gpus_per_node, dgx.intra_node.name, dgx.inter_node.name) == \
        ("a100-80gb", 8, "nvlink3", "ib-hdr")
    # One GPU's share of the node's 8 HDR NICs: 8 * 25 GB/s / 8 GPUs, exact.
    assert dgx.nic_bytes_per_s == 25e9


def test_unknown_names_list_the_known_ones():
    catalog = load_catalog()
    for lookup, name in ((catalog.gpu, "v100"), (catalog.link, "nvlink9"), (catalog.cluster, "dgx-1")):
        with pytest.raises(PlanError) as error:
            lookup(name)
        assert repr(name) in str(error.value)
    message = str(pytest.raises(PlanError, catalog.gpu, "v100").value)
    assert all(gpu in message for gpu in GPUS)


def test_a_cluster_from_names_defaults_to_the_gpus_own_link_and_checks_link_kinds():
    catalog = load_catalog()
    built = cluster(catalog, gpu="h100-sxm", gpus_per_node=8, inter_node="ib-ndr", nics_per_node=8)
    assert built.intra_node.name == "nvlink4" and built.host.name == "pcie-gen5"
    with pytest.raises(PlanError) as error:
        cluster(catalog, gpu="h100-sxm", gpus_per_node=0, inter_node="nvlink4", nics_per_node=8)
    assert "gpus_per_node=0" in str(error.value) and "inter_node='nvlink4' is a 'intra' link" in str(error.value)


def test_a_user_file_merges_over_the_packaged_entries(tmp_path):
    path = _write(tmp_path, """
gpus:
  h100-sxm: {hbm_gbps: 3000}
  my-gpu: {bf16_tflops: 100, fp8_tflops: null, hbm_gb: 32, hbm_gbps: 900, sms: 80, matmul_fraction_bf16: 0.7,
           matmul_fraction_fp8: null, hbm_fraction: 0.9, attention_fraction: 0.5, intra_node: nvlink3}
links:
  my-nic: {gbps: 12.5, collective_gbps: 12.5, latency_us: 20, kind: inter}
""")
    catalog = load_catalog(path)
    h100 = catalog.gpu("h100-sxm")
    assert h100.hbm_gbps == 3000 and h100.bf16_tflops == 989.5  # the other fields stay the packaged ones
    assert catalog.gpu("my-gpu").sms == 80 and catalog.link("my-nic").bytes_per_s == 12.5e9
    assert catalog.link("my-nic").channels == DEFAULT_CHANNELS["inter"] == 16  # left to its kind's figure
    assert catalog.link("nvlink3").channels == 24  # the packaged, cited one
    assert catalog.sources == (str(PACKAGED_CATALOG), str(path))
    assert load_catalog().gpu("h100-sxm").hbm_gbps == 3350  # the packaged catalog itself is untouched


def test_every_bad_entry_is_named_at_load_time(tmp_path):
    path = _write(tmp_path, """
gpus:
  h100-sxm: {hbm_gbps: -1, matmul_fraction_bf16: 1.5, intra_node: nvlink9, colour: green}
  half-gpu: {bf16_tflops: 100}
links:
  nvlink3: {kind: sideways}
  ib-hdr: {channels: 0}
""")
    with pytest.raises(PlanError) as error:
        load_catalog(path)
    message = str(error.value)
    for part in ("gpus.h100-sxm.hbm_gbps=-1", "gpus.h100-sxm.matmul_fraction_bf16=1.5", "'nvlink9'",
                 "unknown fields ['colour']", "gpus.half-gpu: missing fields", "links.nvlink3.kind='sideways'",
                 "links.ib-hdr.channels=0 must be an integer >= 1", str(path)):
        assert part in message


def test_a_file_that_is_not_a_catalog_says_so(tmp_path):
    with pytest.raises(PlanError, match="not valid YAML"):
        load_catalog(_write(tmp_path, "gpus: [unclosed"))
    with pytest.raises(PlanError, match=r"unknown sections \['nodes'\]"):
        load_catalog(_write(tmp_path, "nodes: {}"))
    with pytest.raises(PlanError, match="cannot be read"):
        load_catalog(tmp_path / "missing.yaml")


def test_fp8_on_a_gpu_without_it_is_refused():
    with pytest.raises(PlanError, match="a100-80gb.*no FP8"):
        load_catalog().gpu("a100-80gb").peak_flops("fp8")
