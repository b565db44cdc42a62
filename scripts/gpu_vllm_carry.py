"""Pack vLLM's CUDA build for the GPU machine (no network, at most 64 MiB of files per call), beside the run stack.

    python scripts/gpu_vllm_carry.py OUT_DIR [--part-mib 56]      # or: scripts/gpu_check.sh --vllm --download

Which vLLM: 0.22.0 to 0.25.1 pin `torch==2.11.0` (the GPU image's torch, 2.11.0+cu130), and PyPI's
`manylinux_2_28_x86_64` wheel of each is the CUDA 13 build (its extensions link `libcudart.so.13`; its extras name
`nvidia-cutlass-dsl[cu13]`, `humming-kernels[cu13]`); 0.25.1 is the newest of them and its engine API is the one
`engines/rollout/vllm_rollout.py` calls (layerwise reload, `worker_extension_cls`, sleep tags, `logprobs_mode`).

What travels: the wheel and the packages it imports on an offline `LLM.generate` of a dense text model that neither
the GPU image (KINDS.md's list) nor the run stack (`scripts/gpu_stack.py`) holds, all at the versions pip resolved
for vLLM 0.25.1 on CPython 3.12 (`CARRIED`); installed with `pip --target` into `OUT_DIR/vllm-site`, pruned
(`PRUNE`), written as `OUT_DIR/vllm.tar.xz.part-*` with `OUT_DIR/vllm.sha256`. `scripts/gpu_check.sh --vllm` unpacks
them there and puts the folder on PYTHONPATH after the stack's. `LEFT_OUT` names each requirement that does not
travel and why: imported only by the OpenAI server, structured output, video or audio, MoE / MLA / other
kernels a dense model on Hopper never loads, or guarded by vLLM itself (`try: import ... except ImportError`).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_stack import PLATFORMS, download, write_parts  # noqa: E402

VLLM = "vllm==0.25.1"
CARRIED = [  # vLLM's imports on the offline path that neither the GPU image nor the run stack holds
    "openai==3.57.0", "jiter==0.19.0",  # vllm.entrypoints.chat_utils (imported by vllm.entrypoints.llm)
    "openai-harmony==0.0.8",  # ditto, at module level
    "pyzmq==27.3.0", "msgspec==0.22.0",  # the engine core's messages between the LLM and its process
    "cbor2==6.3.0", "blake3==1.0.11", "pybase64==1.5.1",  # prefix-cache hashing, request serialisation
    "partial-json-parser==0.2.1.1.post7", "ijson==3.6.0", "setproctitle==1.3.8", "lark==1.2.2",
    "diskcache==5.6.3", "watchfiles==1.3.0",
    "depyf==0.20.0", "astor==0.8.1",  # torch.compile's bytecode dump (vllm.compilation)
    "compressed-tensors==0.17.0", "loguru==0.7.3",  # the quantization registry
]  # fmt: skip
LEFT_OUT = {  # vLLM 0.25.1's requirements absent from the image and the stack that do not travel, and why
    "flashinfer-python": "FlashInfer attention and sampler: off by default; Hopper takes FlashAttention 3",
    "flashinfer-cubin": "FlashInfer's prebuilt kernels (437 MiB), as above",
    "nvidia-cutlass-dsl": "CuTe DSL kernels (FlashAttention 4 on Blackwell, quack, humming): guarded imports",
    "nvidia-cutlass-dsl-libs-base": "ditto (71 MiB)",
    "nvidia-cutlass-dsl-libs-cu13": "ditto (75 MiB)",
    "quack-kernels": "CuTe DSL kernels, as above",
    "humming-kernels": "CuTe DSL kernels, as above",
    "cuda-python": "the CuTe DSL's bindings (the image has cuda-bindings)",
    "cuda-tile": "ditto",
    "nvidia-cuda-nvcc": "a compiler for the DSLs (the image has nvcc 13.0)",
    "nvidia-cuda-crt": "ditto",
    "nvidia-nvvm": "ditto (69 MiB)",
    "nvidia-cuda-cccl": "ditto",
    "nvidia-cuda-tileiras": "ditto (39 MiB)",
    "tilelang": "TileLang kernels (MLA, sparse attention): DeepSeek-style models only",
    "apache-tvm-ffi": "TileLang's runtime",
    "torch-c-dlpack-ext": "ditto",
    "z3-solver": "ditto (28 MiB)",
    "tokenspeed-mla": "MLA decode kernels: DeepSeek-style models only",
    "tokenspeed-triton": "ditto (90 MiB)",
    "nvidia-cudnn-frontend": "cuDNN attention for vision encoders",
    "fastsafetensors": "an optional loader (`load_format=fastsafetensors`), guarded import",
    "xgrammar": "structured output (guided decoding), imported when a request asks for it",
    "llguidance": "ditto",
    "outlines-core": "ditto",
    "lm-format-enforcer": "ditto",
    "interegular": "ditto",
    "mistral-common": "Mistral's tokenizer, imported for Mistral models only",
    "pycountry": "mistral-common's",
    "torchcodec": "video decoding, guarded import",
    "pynvvideocodec": "video decoding (41 MiB)",
    "nvtx": "profiling ranges, imported when profiling is asked for",
    "pyelftools": "the DSLs' loaders",
    "anthropic": "the Anthropic-compatible server",
    "mcp": "the server's tool calls",
    "mcp-types": "ditto",
    "model-hosting-container-standards": "the server's SageMaker routes",
    "prometheus-fastapi-instrumentator": "the server's metrics",
    "sse-starlette": "the server",
    "fastapi-cli": "the server",
    "fastapi-cloud-cli": "the server",
    "rich-toolkit": "the server's CLI",
    "rignore": "the server's CLI",
    "fastar": "the server's CLI",
    "sentry-sdk": "the server's CLI",
    "httptools": "uvicorn's parser (the server)",
    "python-multipart": "the server's uploads",
    "email-validator": "the server's request models",
    "dnspython": "ditto",
    "pyjwt": "the server's auth",
    "supervisor": "the server's process manager",
    "jmespath": "the server's tool calls",
    "agent-detector": "the CLI's telemetry",
    "detect-installer": "ditto",
    "opentelemetry-exporter-otlp": "request tracing (`--otlp-traces-endpoint`), guarded import",
    "opentelemetry-exporter-otlp-proto-grpc": "ditto",
    "opentelemetry-exporter-otlp-proto-http": "ditto",
    "opentelemetry-exporter-otlp-proto-common": "ditto",
    "opentelemetry-exporter-otlp-common": "ditto",
    "opentelemetry-exporter-http-transport": "ditto",
    "opentelemetry-semantic-conventions-ai": "ditto",
}
PRUNE = {  # inside the installed site: what a dense text model on one Hopper GPU never loads
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": "FlashAttention 2 (78 MiB): SM 9.x takes FlashAttention 3; guarded",
    "vllm/_moe_C_stable_libtorch.abi3.so": "MoE kernels (38 MiB): a dense model; its import is suppressed if absent",
    "vllm/vllm-rs": "the Rust front-end binary, used only with VLLM_RUST_FRONTEND_PATH",
    "vllm/third_party/deep_gemm": "DeepGEMM (FP8 GEMMs; built for CPython 3.13 and 3.14 only)",
    "vllm/benchmarks": "vLLM's benchmark scripts",
}


def prune(site: Path, paths: dict[str, str] = PRUNE) -> int:
    """Remove `paths` (files or folders, relative to `site`) and every `__pycache__`; returns the bytes removed."""
    removed = 0
    targets = [site / rel for rel in paths] + list(site.rglob("__pycache__"))
    for target in targets:
        if target.is_dir():
            removed += sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
            shutil.rmtree(target)
        elif target.exists():
            removed += target.stat().st_size
            target.unlink()
    return removed


def main() -> None:
    """Download, install into `OUT_DIR/vllm-site`, prune, and write the parts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--part-mib", type=int, default=56)
    args = parser.parse_args()
    out: Path = args.out
    wheels, site = out / "vllm-wheels", out / "vllm-site"
    shutil.rmtree(site, ignore_errors=True)
    wheels.mkdir(parents=True, exist_ok=True)
    pins = [VLLM, *CARRIED]
    download(pins, wheels)
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
               "--target", str(site), "--only-binary=:all:", "--python-version=3.12", "--implementation=cp",
               *[f"--platform={p}" for p in PLATFORMS], *map(str, sorted(wheels.glob("*.whl")))]  # fmt: skip
    subprocess.run(install, check=True)
    removed = prune(site)
    size = sum(f.stat().st_size for f in site.rglob("*") if f.is_file())
    parts = write_parts(out, "vllm-site", "vllm", args.part_mib, level=9)
    total = sum(p.stat().st_size for p in parts)
    sizes = ", ".join(f"{p.name} {p.stat().st_size >> 20} MiB" for p in parts)
    print(f"{len(pins)} packages, {size >> 20} MiB installed ({removed >> 20} MiB pruned), {total >> 20} MiB xz")
    print(f"{len(parts)} parts in {out}: {sizes}")


if __name__ == "__main__":
    main()
