"""What a node offers a run (runtime/environment.py), as the acceptance run records it."""

import json

from megatron_stem.runtime import environment


def test_infiniband_ports_are_read_from_the_kernel_s_tree(tmp_path):
    for device, port, state in (("mlx5_0", "1", "4: ACTIVE"), ("mlx5_1", "1", "1: DOWN")):
        folder = tmp_path / device / "ports" / port
        folder.mkdir(parents=True)
        (folder / "state").write_text(f"{state}\n")
        (folder / "rate").write_text("400 Gb/sec (4X NDR)\n")
        (folder / "link_layer").write_text("InfiniBand\n")
    found = environment.infiniband(tmp_path)
    assert [(p["device"], p["state"], p["rate"]) for p in found] == [
        ("mlx5_0", "4: ACTIVE", "400 Gb/sec (4X NDR)"), ("mlx5_1", "1: DOWN", "400 Gb/sec (4X NDR)")]
    assert environment.infiniband(tmp_path / "none") == []


def test_a_node_s_record_names_its_versions_and_the_kernel_its_tables_run(tmp_path, monkeypatch):
    monkeypatch.setattr(environment.jit_ops, "build_all_within", lambda seconds: False)
    assert environment.main(["--out", str(tmp_path), "--build-within", "1"]) == 0
    (record,) = tmp_path.glob("*.json")
    found = json.loads(record.read_text())
    assert found["gpus"] == 0 and found["gpu"] is None  # this machine: a CPU
    assert found["torch"] and found["megatron-core"] and found["deepspeed"]
    assert (found["ops_built"], found["kernel"]) == (False, "torch")
