"""CPU checks of the CUDA library's build: nvcc compiles it without spills, the barrier's PTX has the
intended orderings, the C ABI exports its functions and returns errors (no GPU here)."""

from __future__ import annotations

import ctypes
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graphar import _cuda
from graphar.errors import GrapharUnavailable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))  # tools/ is not a package: by path
import testing_library

MB = 1 << 20
needs_nvcc = pytest.mark.skipif(_cuda.find_nvcc() is None, reason="nvcc not found")


# ---- the build -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    """One build for sm_90a and sm_80 with ptxas statistics and the intermediate PTX kept (a file per
    translation unit and target)."""
    out = tmp_path_factory.mktemp("graphar-build")
    lib = out / _cuda.LIB_NAME
    nvcc = _cuda.find_nvcc()
    commands = _cuda.compile_commands(nvcc, _cuda.source_dir(), out, ["90a", "80"])
    keep = ["-Xptxas", "-v", "--keep", "--keep-dir", str(out)]
    log = _cuda.run_parallel([[*c, *keep] for c in commands.values()], cwd=out)
    result = subprocess.run(_cuda.link_command(nvcc, list(commands), lib), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-4000:]
    return lib, out, log


def _kernel_stats(ptxas_log: str) -> dict[str, str]:
    """Kernel (mangled name, arch) -> its 'stack frame / spill' line."""
    stats = {}
    for m in re.finditer(r"Function properties for (\S+)\n\s*(.*spill loads)", ptxas_log):
        stats.setdefault(m.group(1), m.group(2))
    return stats


@needs_nvcc
def test_kernels_have_no_spills_or_local_memory(build) -> None:
    _, _, log = build
    stats = _kernel_stats(log)
    kernels = {name: line for name, line in stats.items() if re.search(r"(one|two)_(stage|shot)", name)}
    assert len(kernels) == 60, sorted(kernels)  # ws 2, 4, 6, 8 x 3 dtypes x 5 (2 v1, 2 push, fused norm)
    for name, line in kernels.items():
        assert line.startswith("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"), (name, line)


def _ptx(out: Path) -> str:
    """The sm_90a PTX of every translation unit, one after the other."""
    return "\n".join(p.read_text() for p in sorted(out.glob("*.ptx")) if "compute_90a" in p.name or "sm_90a" in p.name)


def _ptx_function(ptx: str, fragment: str) -> str:
    start = ptx.index(".entry " + next(n for n in re.findall(r"\.entry (\S+)\(", ptx) if fragment in n))
    return ptx[start : ptx.index("\n}", start)]


@needs_nvcc
def test_barrier_ptx_has_the_intended_orderings(build) -> None:
    _, out, _ = build
    ptx = _ptx(out)
    one = _ptx_function(ptx, "one_stageI13__nv_bfloat16Li2E")
    two = _ptx_function(ptx, "two_stageI13__nv_bfloat16Li8E")
    for body in (one, two):
        # fused copy-in entry and 2stage middle: release store / acquire spin; plain entry and 1stage
        # exit: volatile; every spin bounded by the global timer; never a trap
        for instruction in (
            "st.release.sys.global.u32",
            "ld.acquire.sys.global.u32",
            "st.volatile.global.u32",
            "ld.volatile.global.u32",
            "%globaltimer",
            "bar.red.or.pred",
        ):
            assert instruction in body
        assert "trap" not in body and ".local" not in body
        assert "ld.global.v4.u32" in body or "ld.v4.u32" in body  # 16-byte packs
    # block syncs: before the fenced entry, before the exit (1stage) or the middle (2stage), and before
    # the block counts itself out; the copy-in path's claim is a vote (bar.red), like every barrier's.
    # The graph path's claimer (warp 1) waits at named barrier 1 until warp 0 cleared the verdict word
    # its waiting lanes poll; warp 0 passes it without waiting.
    for body in (one, two):
        named = re.findall(r"bar\.(?:sync|arrive) 1, 64;", body)
        assert named == ["bar.arrive 1, 64;", "bar.sync 1, 64;"], named
        assert len(re.findall(r"bar\.sync\s+\d+;", body)) == 3


_CLAIM_PROGRAM = r"""
#include <cstdio>
#include <random>
#include "claim.cuh"
using namespace graphar;
// What count_in leaves in Signal::running when these launches' blocks are in: (tag, blocks) pairs.
template <typename Words>
unsigned long long running(const int (*launches)[2], int n, Words word) {
  unsigned long long sum = 0;
  for (int i = 0; i < n; i++) sum += launches[i][1] * ((word(launches[i][0]) << kRunningCountBits) + 1);
  return sum;
}
int main() {
  auto raw = [](unsigned long long tag) { return tag; };  // what the claim counted before it was hashed
  auto hashed = [](unsigned long long tag) { return claim_word(tag); };
  // Launch 101's block beside one block each of launches 100 and 102.
  const int three[3][2] = {{101, 1}, {100, 1}, {102, 1}};
  printf("raw %d hashed %d\n", only_this_launch(running(three, 3, raw), 101),
         only_this_launch(running(three, 3, hashed), claim_word(101)));
  // Alone: any block count of one launch; never alone: 1 to 3 other launches of nearby tags beside it.
  std::mt19937_64 rng(7);
  long alone = 0, fooled = 0, trials = 0;
  for (int t = 0; t < 200000; t++) {
    const unsigned long long mine = 1 + rng() % 100000;
    int launches[4][2] = {{static_cast<int>(mine), 1 + static_cast<int>(rng() % 64)}};
    alone += only_this_launch(running(launches, 1, hashed), claim_word(mine));
    const int others = 1 + static_cast<int>(rng() % 3);
    for (int i = 1; i <= others; i++) {
      const long delta = 1 + static_cast<long>(rng() % 8);
      launches[i][0] = static_cast<int>(rng() % 2 ? mine + delta : mine - delta);
      launches[i][1] = 1 + static_cast<int>(rng() % 64);
    }
    fooled += only_this_launch(running(launches, others + 1, hashed), claim_word(mine));
    trials++;
  }
  printf("alone %ld of %ld, fooled %ld\n", alone, trials, fooled);
}
"""


@needs_nvcc
def test_the_claim_tells_three_launches_apart(tmp_path: Path) -> None:
    """A block is alone when Signal::running is its block count times its launch's claim word. With the
    tag itself as the word, launch 101 beside launches 100 and 102 (one block each) believed itself
    alone; the hashed word tells it, and 200000 random sets of up to three nearby launches beside one."""
    source = tmp_path / "claim.cu"
    source.write_text(_CLAIM_PROGRAM)
    program = tmp_path / "claim"
    nvcc = _cuda.find_nvcc()
    subprocess.run([nvcc, "-std=c++17", "-I", str(_cuda.source_dir()), "-o", str(program), str(source)], check=True)
    lines = subprocess.run([str(program)], capture_output=True, text=True, check=True).stdout.splitlines()
    assert lines == ["raw 1 hashed 0", "alone 200000 of 200000, fooled 0"], lines


# One instance of each all-reduce kernel, as its mangled name holds it (dtype, world size).
ALL_REDUCE_KERNELS = (
    "one_stageI13__nv_bfloat16Li2E",
    "two_stageIfLi8E",
    "push_one_shotI13__nv_bfloat16Li2E",
    "push_two_shotIfLi8E",
    "push_one_shot_normI6__halfLi4E",
)


@needs_nvcc
def test_every_kernel_claims_the_communicator_first_and_releases_it_last(build) -> None:
    """One kernel of a communicator at a time per rank (claim.cuh, and barrier.cuh claim_block): each block counts
    itself in (acquire) before any flag, slot or buffer store, with its entry's own loads already in
    flight, and out (relaxed) at its very end; an exchange's last copy then gives the exchange's lease
    back (all_to_all.cuh exchange_lease). 1stage counts out in one of two places: right after its exit
    barrier's closing block sync when it passed, after release_block's otherwise. The v1 kernels' graph
    path claims beside its entry barrier (claim_and_start): the barrier's vote, which carries the claim,
    comes before any load of the data."""
    _, out, _ = build
    ptx = _ptx(out)
    for fragment in (*ALL_REDUCE_KERNELS, "gather_all_to_allILi4E"):
        body = _ptx_function(ptx, fragment)
        claim, release = body.index("atom.acquire.gpu.global.add.u64"), body.index("red.relaxed.gpu.global.add.u64")
        shared = [body.find(op) for op in ("st.volatile", "st.release", "ld.volatile.global.v4", "st.global.v4")]
        # the block's count, then the lease; 1stage's count on its two paths
        releases = 2 if fragment.startswith(("gather", "one_stage")) else 1
        assert claim < min(i for i in shared if i >= 0) and body.count("red.relaxed.gpu") == releases, fragment
        assert "red.release" not in body and all(i < release for i in shared), fragment
        if fragment.startswith("one_stage"):
            assert body.rindex("bar.red.or") < release, "1stage counts out before its exit barrier's block sync"
        if fragment.startswith(("one_stage", "two_stage")):
            beside = body.rindex("atom.acquire.gpu.global.add.u64")
            vote = body.index("bar.red.or", beside)
            assert beside > claim and not re.search(r"ld(\.global)?(\.nc)?\.v4", body[beside:vote]), fragment
        # What the entry reads before it may wait (the barrier's failed flag and counts, the push epoch
        # and failed flag) goes out ahead of the claim: after the acquire it would wait a round trip.
        before_claim = body[:claim].count("ld.volatile.global.u32")
        assert before_claim >= 2, (fragment, before_claim)
    lease = _ptx_function(ptx, "exchange_lease")
    assert lease.count("atom.acquire.gpu.global.add.u64") == 1 and "red." not in lease


@needs_nvcc
def test_all_reduce_ptx_waits_for_the_previous_kernel_first(build) -> None:
    """PDL (pdl.cuh): griddepcontrol.wait before any global access (the input, the slot pointers, the
    counts, the epoch, the slots, the claim), then the early launch of the next kernel."""
    _, out, _ = build
    ptx = _ptx(out)
    for fragment in ALL_REDUCE_KERNELS:
        body = _ptx_function(ptx, fragment)
        wait = body.index("griddepcontrol.wait")
        first_access = min(
            body.index(op) for op in ("ld.global", "st.global", "ld.volatile", "st.volatile", "atom.") if op in body
        )
        assert wait < first_access < len(body), fragment
        assert wait < body.index("griddepcontrol.launch_dependents"), fragment


@needs_nvcc
def test_push_ptx_moves_whole_slots(build) -> None:
    _, out, _ = build
    ptx = _ptx(out)
    for fragment in ("push_one_shotI13__nv_bfloat16Li2E", "push_two_shotIfLi8E", "push_one_shot_normI6__halfLi4E"):
        body = _ptx_function(ptx, fragment)
        # slots stored and polled whole with volatile 16-byte accesses
        for instruction in ("st.volatile.global.v4.u32", "ld.volatile.global.v4.u32", "%globaltimer"):
            assert instruction in body, (fragment, instruction)
        assert "trap" not in body and ".local" not in body and "ld.acquire" not in body, fragment


@needs_nvcc
def test_fused_norm_ptx_reduces_in_a_fixed_order(build) -> None:
    """The fused norm's split rows hand their segments' partial sums on through scratch words (a 64-bit
    volatile store and load each, tag and value together) and sum them in a fixed order: no atomic but
    the claim and its release, so every rank, and every grid, rounds the mean square alike."""
    _, out, _ = build
    ptx = _ptx(out)
    for fragment in ("push_one_shot_normI13__nv_bfloat16Li2E", "push_one_shot_normIfLi8E"):
        body = _ptx_function(ptx, fragment)
        assert "st.volatile.global.u64" in body and "ld.volatile.global.u64" in body, fragment
        assert "shfl.sync.bfly" in body and "bar.red.or.pred" in body, fragment
        atomics = re.findall(r"(?<![\w.])(atom|red)\.[\w.]+", body)  # not bar.red, the block's vote
        assert sorted(atomics) == ["atom", "red"], (fragment, atomics)  # the claim and its release


@needs_nvcc
def test_the_fused_norm_grid_takes_short_rows_whole_and_splits_long_ones(build) -> None:
    """(blocks, threads per block, blocks per row) of the fused norm's launch: a row of up to 512 packs
    (bf16 hidden 4096) goes to one block, a pack per thread; a longer one is split into slices of about
    256 packs while the rows' blocks fit the launch's 64; slices are whole segments of 8 packs, no block
    without any; a split that needs more scratch words than there are is cut down to fit."""
    lib = testing_library.build(build[1], _cuda.source_dir())
    exported = subprocess.run(["nm", "-D", "--defined-only", lib._name], capture_output=True, text=True).stdout
    assert set(re.findall(r"\b(graphar_\w+)\b", exported)) == set(testing_library.PROTOTYPES)
    assert ctypes.sizeof(testing_library._EdgeData) == 8  # CUgraphEdgeData

    def grid(tokens: int, hidden: int, block_limit: int = 64, scratch_words: int = 1 << 20, max_split: int = 0):
        return testing_library.norm_grid(
            None, tokens * hidden * 2, hidden * 2, block_limit, scratch_words, max_split, lib
        )

    for tokens in (1, 2, 8, 32, 64):
        assert grid(tokens, 4096) == (tokens, 512, 1), tokens
    for tokens in (1, 2, 8, 16):
        assert grid(tokens, 8192) == (4 * tokens, 256, 4), tokens
    assert grid(32, 8192) == (64, 512, 2)  # 64 blocks at most: 2 a row
    for tokens in (64, 128, 512):
        assert grid(tokens, 4096) == (64, 512, 1)
        assert grid(tokens, 8192) == (64, 512, 1)  # 2 packs per thread
    assert grid(1, 8192, max_split=1) == (1, 512, 1)
    assert grid(1, 8192, max_split=3) == (3, 352, 3)  # 128 segments in slices of 43
    assert grid(1, 8192, scratch_words=0) == (1, 512, 1)
    assert grid(1, 8192, scratch_words=2 * 128) == (2, 512, 2)  # 128 segments per reader block
    assert grid(1, 4104) == (3, 192, 3)  # 513 packs, 65 segments: 22, 22 and 21
    assert grid(1, 32768) == (16, 256, 16)  # the longest rows
    assert grid(8, 32768) == (64, 512, 8)  # 64 blocks at most: slices of 512
    assert grid(64, 32768) == (64, 512, 1)  # 8 packs per thread
    assert grid(1, 8) == (1, 32, 1)  # one pack
    assert grid(4, 32768, block_limit=36) == (36, 480, 9)  # before Hopper: 36 blocks, whole segments
    with pytest.raises(RuntimeError, match="rows of 24"):
        testing_library.norm_grid(None, 72, 24, 64, 0, 0, lib)


@needs_nvcc
def test_c_abi_exports_and_returns_errors(build) -> None:
    lib_path, _, _ = build
    # No libcuda dependency: loads on a machine without a driver. Every prototype binds (is exported).
    lib = _cuda.bind(ctypes.CDLL(str(lib_path)), _cuda.PROTOTYPES)
    assert lib.graphar_build_id().decode() == _cuda.source_hash(_cuda.source_dir())
    # the C ABI and nothing of graphar's C++ (the helpers its .cu files share are hidden)
    exported = subprocess.run(["nm", "-D", "--defined-only", str(lib_path)], capture_output=True, text=True).stdout
    assert set(re.findall(r"\b(graphar_\w+)\b", exported)) == set(_cuda.PROTOTYPES)
    assert "graphar" not in re.sub(r"\bgraphar_\w+\b", "", exported)
    handle = ctypes.c_void_p()
    assert lib.graphar_comm_create(0, 3, MB, 36, 0, 16, ctypes.byref(handle)) == -1
    assert b"world size 3" in lib.graphar_last_error() and handle.value is None
    assert lib.graphar_comm_create(0, 2, MB, 65, 0, 16, ctypes.byref(handle)) == -1
    assert b"block limit 65" in lib.graphar_last_error()
    if not torch.cuda.is_available():  # a CUDA failure is an error code and a message, never an exit
        assert lib.graphar_comm_create(0, 2, MB, 36, 0, 16, ctypes.byref(handle)) > 0
        assert b"cuda" in lib.graphar_last_error().lower() and handle.value is None


def test_nvcc_command_targets(monkeypatch) -> None:
    monkeypatch.setenv("GRAPHAR_CUDA_ARCHS", "90a; 80")
    src = _cuda.source_dir()
    commands = _cuda.compile_commands("nvcc", src, Path("objects"), _cuda.cuda_archs())
    # every .cu file is its own translation unit, and every one is in the build id's hash; the op
    # library's source is in the hash too, and in no translation unit of the CUDA library
    assert sorted(c[c.index("-o") - 1] for c in commands.values()) == sorted(str(p) for p in src.glob("*.cu"))
    assert {p.name for p in src.glob("*.cu")} <= {p.name for p in src.iterdir() if p.suffix in _cuda._SOURCE_SUFFIXES}
    assert (src / _cuda._TORCH_SOURCE).suffix in _cuda._SOURCE_SUFFIXES
    assert not any(str(src / _cuda._TORCH_SOURCE) in c for c in commands.values())
    for command in commands.values():
        assert "-gencode=arch=compute_90a,code=sm_90a" in command
        assert "-gencode=arch=compute_80,code=sm_80" in command
        assert "-gencode=arch=compute_80,code=compute_80" in command  # PTX for newer GPUs
        assert {"-c", "-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden"} <= set(command)
        assert f"-DGRAPHAR_BUILD_ID={_cuda.source_hash(src)}" in command
        assert r"-DGRAPHAR_TARGETS=sm_90a\,sm_80\,compute_80" in command  # graphar_targets() says so (doctor)
    assert "-shared" in _cuda.link_command("nvcc", list(commands), Path("out.so"))
    monkeypatch.setenv("GRAPHAR_CUDA_ARCHS", "sm_90")
    with pytest.raises(ValueError, match="GRAPHAR_CUDA_ARCHS"):
        _cuda.cuda_archs()


def test_csrc_headers_hold_no_entry_points() -> None:
    """The C ABI's definitions live in .cu files by concern; the headers hold declarations, templates and
    device code, and name no namespace for their includers."""
    for header in _cuda.source_dir().glob("*.cuh"):
        text = re.sub(r"//[^\n]*", "", header.read_text())
        assert 'extern "C"' not in text and not re.search(r"^using namespace", text, re.M), header.name
        assert not re.search(r"^namespace \{", text, re.M), header.name  # nothing per translation unit


def test_build_without_nvcc_is_a_clear_error(monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(_cuda, "find_nvcc", lambda: None)
    with pytest.raises(GrapharUnavailable, match="nvcc"):
        _cuda.build_library(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")
def test_library_without_gpu() -> None:
    assert _cuda.available() is False
    with pytest.raises(GrapharUnavailable, match="CUDA device"):
        _cuda.library()
