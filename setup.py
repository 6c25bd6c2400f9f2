"""Packaging for megatron_tuning.

Shipped tuning tables live in the top-level ``configs/`` folder (one sub-folder per GPU arch, e.g.
``configs/sm90/``) so that code review sees them next to the code. A regular install copies that
folder into the package as ``megatron_tuning/_configs``; an editable install reads it in place.
``megatron_tuning.tables.search.shipped_tables_dir()`` hides the difference.
"""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"

# The linters are pinned: a new release may reformat or flag code that passed, failing CI unprompted.
TEST_REQUIRES = [
    "pytest>=7",
    "hypothesis",
    "pytest-timeout",
    "pytest-xdist>=3.5",
    "import-linter>=2.1",
    "ruff==0.17.6",
    "mypy==2.4.1",
]

packages = find_packages(include=["megatron_tuning", "megatron_tuning.*"])
package_dir: dict[str, str] = {}
package_data: dict[str, list[str]] = {}
if (HERE / "configs").is_dir():
    # Map the data-only folder onto a sub-package so that wheels (and thus `pip install .`) carry it.
    packages.append("megatron_tuning._configs")
    package_dir["megatron_tuning._configs"] = "configs"
    package_data["megatron_tuning._configs"] = ["**/*"]  # every table format and its README

setup(
    name="megatron_tuning",
    version="0.1.0",
    description="Deterministic, rank-consistent Triton autotuning: pinned configs, tables, agreement checks",
    long_description=README.read_text(encoding="utf-8") if README.exists() else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=packages,
    package_dir=package_dir,
    package_data=package_data,
    include_package_data=False,
    # filelock >= 3.20.1: older releases follow a planted <table>.lock symlink and truncate its
    # target (CVE-2025-68146); tables/files.py names the refused lock path.
    install_requires=["torch", "triton", "msgpack", "numpy", "filelock>=3.20.1", "platformdirs"],
    extras_require={
        "test": TEST_REQUIRES,
        "plot": ["matplotlib"],
        "progress": ["tqdm"],
        "nvml": ["nvidia-ml-py"],  # score's NVML clock evidence (docs/score.md); without it: null fields
    },
    entry_points={"console_scripts": ["megatron-tuning = megatron_tuning.commands:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Operating System :: POSIX :: Linux",
    ],
)
