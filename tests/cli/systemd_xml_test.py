#!/usr/bin/env python3
"""`duet systemd generate --xml`: units for another machine, planned from its hwloc XML
export (tests/fixtures/hwloc: an NVIDIA DGX-2, 16 V100s on two packages, each package
one NUMA node; the export keeps two cores of each).

The expectations come from the export itself, read here with Python's XML parser
(not from duet's planner): each NVIDIA display or 3D controller (vendor 10de, class
03xx) in PCI bus order is cuda:N, and the hardware threads near it are the cpuset of
the first non-I/O object above it. Checked in the generated drop-ins: each GPU's
prefill and decode worker runs on that GPU (--device in DUET_WORKER_ARGS), its
CPUAffinity= lies in the GPU's near threads, its NUMAMask= is the NUMA node holding
them; with one GPU of each package no thread is given to two workers; the front has a
CPUAffinity= of its own. An export that says the GPUs' memory (hwloc's CUDA backend)
needs no --gpu-memory. Refused with the reason: a GPU the export does not have, an
export that does not say the GPUs' memory without --gpu-memory, --gpu-memory without
--xml.

Usage: systemd_xml_test.py path/to/duet path/to/model.gguf path/to/nvidiaDGX2.xml
"""
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

from duet_e2e import check

DUET, MODEL, XML = (os.path.abspath(a) for a in sys.argv[1:4])


def cpuset(text):
    """hwloc's bitmap text: 32-bit hex words, most significant first, comma-separated."""
    bits, words = set(), text.split(",")
    for i, w in enumerate(reversed(words)):
        v = int(w, 16)
        bits |= {32 * i + b for b in range(32) if v >> b & 1}
    return bits


def cpu_list(text):
    out = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out |= set(range(int(lo), int(hi or lo) + 1))
    return out


root = ET.parse(XML).getroot()
parent = {c: p for p in root.iter() for c in p}
nodes = {int(o.get("os_index")): cpuset(o.get("cpuset")) for o in root.iter("object") if o.get("type") == "NUMANode"}
gpus = []
for o in root.iter("object"):
    m = re.match(r"(\w{2})\w{2} \[(\w{4}):", o.get("pci_type", ""))
    if o.get("type") != "PCIDev" or not m or m.group(1) != "03" or m.group(2) != "10de":
        continue
    a = parent[o]
    while a.get("type") in ("Bridge", "PCIDev", "OSDev"):
        a = parent[a]
    gpus.append((o.get("pci_busid"), cpuset(a.get("cpuset"))))
gpus.sort()
check(len(gpus) == 16 and len(nodes) == 2, f"the export: {len(gpus)} GPUs, {len(nodes)} NUMA nodes")


def generate(devices, *extra):
    out = tempfile.mkdtemp(prefix="duet-xml-")
    g = subprocess.run([DUET, "systemd", "generate", "--out", out, "--exe", "/usr/local/bin/duet", "--model", MODEL,
                        "--port", "8080", "--xml", XML, "--device", devices, *extra], capture_output=True, text=True)
    return g, out


def drop_in(out, unit):
    with open(os.path.join(out, unit + ".d", "placement.conf")) as f:
        return f.read()


def field(text, key):
    m = re.search(rf"^{key}=(.*)$", text, re.M)
    return m.group(1) if m else None


for devices in ([0, 15], [0, 2, 4, 6, 9, 11, 13, 15]):
    g, out = generate(",".join(f"cuda:{d}" for d in devices), "--gpu-memory", "32")
    check(g.returncode == 0, f"generate --xml --device {devices}: {g.returncode} {g.stdout}{g.stderr}")
    given = {}
    for i, d in enumerate(devices):
        near = gpus[d][1]
        node = [n for n, cpus in nodes.items() if near <= cpus]
        check(len(node) == 1, f"GPU {d} ({gpus[d][0]}) near {sorted(near)}: one NUMA node holds them")
        for role in ("prefill", "decode"):
            unit = f"duet-{role}@{i}.service"
            conf = drop_in(out, unit)
            args = field(conf, "Environment")
            check(args and re.search(rf"--device cuda:{d}\b", args), f"{unit} runs on cuda:{d}: {conf}")
            cpus = cpu_list(field(conf, "CPUAffinity") or "")
            check(cpus and cpus <= near, f"{unit} (GPU {d}) on CPUs {sorted(cpus)}, near {sorted(near)}")
            check(field(conf, "NUMAMask") == str(node[0]) and field(conf, "NUMAPolicy") == "bind",
                  f"{unit} (GPU {d}): NUMA node {node[0]}: {conf}")
            for c in cpus:
                given.setdefault(c, []).append(unit)
    check(field(drop_in(out, "duet-front.service"), "CPUAffinity"), "the front has CPUs of its own")
    if len(devices) == 2:
        shared = {c: u for c, u in given.items() if len(u) > 1}
        check(not shared, f"one GPU of each package: no CPU given twice: {shared}")
    print(f"generate --xml (DGX-2) --device {devices}: each worker on its GPU, on CPUs near it, its NUMA node "
          f"bound{'; no CPU given twice' if len(devices) == 2 else ''}: ok")

# An export made with hwloc's CUDA backend says each GPU's memory (in KiB, an info of
# the GPU's OS device): no --gpu-memory needed. (Here the fixture's NVML devices are given it.)
with open(XML) as f:
    text = f.read()
with_memory = os.path.join(tempfile.mkdtemp(prefix="duet-xml-"), "dgx2-memory.xml")
with open(with_memory, "w") as f:
    f.write(text.replace('<info name="Backend" value="NVML"/>',
                         '<info name="Backend" value="NVML"/><info name="CUDAGlobalMemorySize" value="33554432"/>'))
g = subprocess.run([DUET, "systemd", "generate", "--out", tempfile.mkdtemp(), "--model", MODEL, "--port", "8080",
                    "--xml", with_memory, "--device", "cuda:0,cuda:15"], capture_output=True, text=True)
check(g.returncode == 0, f"an export with the GPUs' memory, no --gpu-memory: {g.stdout}{g.stderr}")
print("an export that says the GPUs' memory (CUDAGlobalMemorySize) needs no --gpu-memory: ok")

g, _ = generate("cuda:16", "--gpu-memory", "32")
check(g.returncode != 0 and "16 NVIDIA GPUs" in g.stderr, f"a GPU the export lacks: {g.stderr}")
g, _ = generate("cuda:0")
check(g.returncode != 0 and "--gpu-memory" in g.stderr, f"no memory in the export: {g.stderr}")
g = subprocess.run([DUET, "systemd", "generate", "--out", tempfile.mkdtemp(), "--model", MODEL, "--port", "8080",
                    "--gpu-memory", "32"], capture_output=True, text=True)
check(g.returncode != 0 and "only with --xml" in g.stderr, f"--gpu-memory without --xml: {g.stderr}")
print("refused with the reason: cuda:16 (the export has 16), no GPU memory in the export, --gpu-memory alone: ok")

# --mps: the units use duet-mps.service (the MPS control daemon): every role wants it
# through the target and the instance, starts after it, and finds its pipes in
# duet.env; without --mps none of that. On the CPU --mps is refused.
g, out = generate("cuda:0,cuda:15", "--gpu-memory", "32", "--mps")
check(g.returncode == 0, f"generate --mps: {g.stdout}{g.stderr}")
with open(os.path.join(out, "duet.env")) as f:
    env = f.read()
check("CUDA_MPS_PIPE_DIRECTORY=/run/duet-mps/pipe\n" in env and "CUDA_MPS_LOG_DIRECTORY=/run/duet-mps/log\n" in env,
      f"duet.env names the daemon's directories: {env}")
with open(os.path.join(out, "duet-mps.service")) as f:
    mps_unit = f.read()
check("ExecStart=/usr/bin/nvidia-cuda-mps-control -d" in mps_unit and "RuntimeDirectory=duet-mps" in mps_unit
      and "Environment=CUDA_MPS_PIPE_DIRECTORY=/run/duet-mps/pipe" in mps_unit, "duet-mps.service written")
for unit in ("duet.target", "duet-instance.service"):
    with open(os.path.join(out, unit + ".d", "roles.conf")) as f:
        conf = f.read()
    check("duet-mps.service" in field(conf, "Wants").split() and field(conf, "After") == "duet-mps.service",
          f"{unit} wants duet-mps.service and starts after it: {conf}")
for i in range(2):
    for role in ("prefill", "decode"):
        conf = drop_in(out, f"duet-{role}@{i}.service")
        check(field(conf, "After") == "duet-mps.service" and "[Unit]" in conf and "[Service]" in conf,
              f"duet-{role}@{i} starts after the daemon: {conf}")
g, out = generate("cuda:0,cuda:15", "--gpu-memory", "32")
with open(os.path.join(out, "duet.env")) as f:
    check("CUDA_MPS" not in f.read(), "without --mps duet.env names no daemon")
check(field(drop_in(out, "duet-prefill@0.service"), "After") is None, "without --mps no After=")
with open(os.path.join(out, "duet-instance.service.d", "roles.conf")) as f:
    check("duet-mps" not in f.read(), "without --mps the instance neither wants nor follows duet-mps.service")
g = subprocess.run([DUET, "systemd", "generate", "--out", tempfile.mkdtemp(), "--model", MODEL, "--port", "8080",
                    "--mps"], capture_output=True, text=True)
check(g.returncode != 0 and "--mps: CUDA MPS shares a GPU" in g.stderr, f"--mps on the CPU: {g.stderr}")
print("--mps: duet-mps.service wanted, the roles after it, its pipes in duet.env; refused on the CPU: ok")
