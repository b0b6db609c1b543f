"""One hardware catalog (issue 48 §3): the profiler's link limits and the planner's link bandwidths are the same
numbers, read from ``job/hardware.yaml`` through ``shardline.job.hardware``; that module is pure (no torch, no
pandas, neither half of shardline), and the file is shipped with the package."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from shardline.job import hardware as hw
from shardline.profiling.matching import links as profiler_links
from shardline.recipes.planning import catalog as planner_catalog

REPO = Path(__file__).resolve().parents[1]
YAML = yaml.safe_load(hw.PACKAGED_HARDWARE.read_text())
# Every name either side knows (an alias is a name of its own, with its entry's numbers).
ENTRY_OF = {name: entry for entry, fields in YAML["links"].items() for name in (entry, *fields.get("aliases", []))}


def test_both_halves_read_the_one_file():
    assert hw.PACKAGED_HARDWARE == REPO / "job" / "hardware.yaml"
    assert planner_catalog.PACKAGED_CATALOG == hw.PACKAGED_HARDWARE
    assert planner_catalog.load_catalog().sources == (str(hw.PACKAGED_HARDWARE),)
    assert not (REPO / "recipes" / "planning" / "catalog.yaml").exists()  # no second copy to drift


def test_every_link_known_to_both_sides_has_one_limit():
    profiler = profiler_links.link_table().links
    planner = planner_catalog.load_catalog()
    both = set(profiler) & set(planner.links)
    assert both == set(ENTRY_OF) == set(profiler) == set(planner.links)
    for name in sorted(both):
        cited = YAML["links"][ENTRY_OF[name]]["gbps"]
        # Exact: one number, read from one place; no arithmetic on either side.
        assert profiler[name].gbps == planner.link(name).gbps == cited, name
        assert profiler[name].source == YAML["links"][ENTRY_OF[name]]["source"], name


def test_the_profilers_rules_name_catalog_links():
    table = profiler_links.link_table()
    for pattern, intra, nic in profiler_links.DEVICE_RULES:
        assert (intra == "" or intra in ENTRY_OF) and nic in ENTRY_OF, pattern
    assert set(profiler_links.HOST_PCIE) | set(profiler_links.HOST_PCIE.values()) <= set(ENTRY_OF)
    assert profiler_links.DEFAULT_NIC in ENTRY_OF and profiler_links.DEFAULT_HOST_PCIE in ENTRY_OF
    assert table.host_link("NVIDIA H100 80GB HBM3")[0].name == "pcie-gen5"


# A Kineto deviceProperties name of each planner GPU: the profiler's device rule for it gives the planner's own
# scale-up link, and the PCIe generation it assumes is the planner's node type's host link.
DEVICE_NAMES = {"a100-40gb": "NVIDIA A100-SXM4-40GB", "a100-80gb": "NVIDIA A100-SXM4-80GB",
                "h100-sxm": "NVIDIA H100 80GB HBM3", "h200": "NVIDIA H200", "b200": "NVIDIA B200",
                "mi300x": "AMD Instinct MI300X"}


@pytest.mark.parametrize("cluster", sorted(YAML["clusters"]))
def test_the_planners_node_types_agree_with_the_profilers_rules(cluster):
    node = planner_catalog.load_catalog().cluster(cluster)
    table = profiler_links.link_table()
    intra, nic = table.device_links(DEVICE_NAMES[node.gpu.name])
    assert intra == node.gpu.intra_node == node.intra_node.name
    assert ENTRY_OF[nic] == ENTRY_OF[node.inter_node.name]  # roce-400 is the planner's roce
    assert table.host_link(DEVICE_NAMES[node.gpu.name])[0].name == node.host.name


def test_the_pcie_gen4_disagreement_is_settled_on_the_published_figure():
    # PCI-SIG: 16 GT/s x 16 lanes x 128/130 (line code) / 8 bits = 31.5 GB/s per direction; the planner said 32.
    assert 16 * 16 * 128 / 130 / 8 == pytest.approx(31.5, abs=0.01)
    assert planner_catalog.load_catalog().link("pcie-gen4").gbps == 31.5
    assert profiler_links.link_table().links["pcie-gen4"].gbps == 31.5


def test_a_user_override_still_merges_over_the_one_catalog(tmp_path):
    path = tmp_path / "site.yaml"
    path.write_text("links:\n  nvlink4: {gbps: 400}\n")
    merged = planner_catalog.load_catalog(path)
    assert merged.link("nvlink4").gbps == 400 and merged.link("nvlink4").collective_gbps == 370
    assert planner_catalog.load_catalog().link("nvlink4").gbps == 450  # the cached catalog is untouched
    assert hw.hardware().link("nvlink4").gbps == 450


def test_a_malformed_catalog_file_names_the_entry_and_field(tmp_path):
    bad = tmp_path / "hw.yaml"
    bad.write_text("links:\n  fast: {gbps: -1, source: x, collective_gbps: 1, latency_us: 1, kind: up, channels: 0}\n"
                   "defaults: {nic: fast, host_pcie: fast}\n")
    with pytest.raises(hw.HardwareError) as error:
        hw.load_hardware(bad)
    message = str(error.value)
    for part in (str(bad), "links.fast", "gbps=-1", "kind='up'", "channels=0"):
        assert part in message
    bad.write_text("links: {}\ndevices:\n  - {match: A100, intra: nvlink9, nic: ib-hdr}\n")
    with pytest.raises(hw.HardwareError, match=re.escape("devices[0].intra: unknown link 'nvlink9'")):
        hw.load_hardware(bad)
    bad.write_text("gpu: {}\n")
    with pytest.raises(hw.HardwareError, match=r"unknown sections \['gpu'\]"):
        hw.load_hardware(bad)


def test_the_yaml_is_package_data():
    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "*.yaml" in data["shardline.job"]


def test_the_catalog_module_imports_with_torch_pandas_and_both_halves_blocked():
    code = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "pandas", "numpy") or name.startswith(
                ("shardline.plugins", "shardline.profiling", "shardline.recipes")):
            raise ImportError(f"blocked {name}")
sys.meta_path.insert(0, Block())
from shardline.job.hardware import hardware
print(hardware().link("nvlink4").gbps)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "450"
