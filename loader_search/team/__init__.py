"""What many workers on many machines share: the storage (URL, masking, retries), the host and
study locks, and the hardware fingerprint that binds a study to one class of machine.

What the layer offers is named here; callers outside it import from ``loader_search.team``.
Names load lazily: the console reads a database error's kind without opening a storage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from loader_search._faces import lazy

_EXPORTS = {
    # the storage
    "open_storage": "loader_search.team._storage",
    "resolve_storage_url": "loader_search.team._storage",
    "check_shared": "loader_search.team._storage",
    "in_memory": "loader_search.team._storage",
    "create_engine": "loader_search.team._storage",
    "STORAGE_ENV": "loader_search.team._storage",
    "DB_TIMEOUT_ENV": "loader_search.team._storage",
    "DEFAULT_STORAGE": "loader_search.team._storage",
    # what a database error means, and retrying through an outage
    "retrying": "loader_search.team._db_errors",
    "outage": "loader_search.team._db_errors",
    "describe_driver_error": "loader_search.team._db_errors",
    "is_busy": "loader_search.team._db_errors",
    "is_read_only": "loader_search.team._db_errors",
    "is_transient": "loader_search.team._db_errors",
    "read_only_error": "loader_search.team._db_errors",
    # passwords kept out of what is shown
    "mask_url": "loader_search.team._masking",
    "scrub_urls": "loader_search.team._masking",
    "has_password": "loader_search.team._masking",
    # the host and study locks
    "host_lock": "loader_search.team._locks",
    "study_lock": "loader_search.team._locks",
    "StudyLockTimeout": "loader_search.team._locks",
    "LOCK_DIR_ENV": "loader_search.team._locks",
    "check_lock_folder": "loader_search.team._lockfiles",
    # the hardware a study is bound to
    "Hardware": "loader_search.team._hardware",
    "collect": "loader_search.team._hardware",
    "gpu_count": "loader_search.team._hardware",
    "gpu_facts": "loader_search.team._hardware",
    "GpuFacts": "loader_search.team._hardware",
    "NO_GPU": "loader_search.team._hardware",
}

__all__ = [
    "DB_TIMEOUT_ENV",
    "DEFAULT_STORAGE",
    "LOCK_DIR_ENV",
    "NO_GPU",
    "STORAGE_ENV",
    "GpuFacts",
    "Hardware",
    "StudyLockTimeout",
    "check_lock_folder",
    "check_shared",
    "collect",
    "create_engine",
    "describe_driver_error",
    "gpu_count",
    "gpu_facts",
    "has_password",
    "host_lock",
    "in_memory",
    "is_busy",
    "is_read_only",
    "is_transient",
    "mask_url",
    "open_storage",
    "outage",
    "read_only_error",
    "resolve_storage_url",
    "retrying",
    "scrub_urls",
    "study_lock",
]

if TYPE_CHECKING:
    from loader_search.team._db_errors import (
        describe_driver_error,
        is_busy,
        is_read_only,
        is_transient,
        outage,
        read_only_error,
        retrying,
    )
    from loader_search.team._hardware import (
        NO_GPU,
        GpuFacts,
        Hardware,
        collect,
        gpu_count,
        gpu_facts,
    )
    from loader_search.team._lockfiles import check_lock_folder
    from loader_search.team._locks import LOCK_DIR_ENV, StudyLockTimeout, host_lock, study_lock
    from loader_search.team._masking import has_password, mask_url, scrub_urls
    from loader_search.team._storage import (
        DB_TIMEOUT_ENV,
        DEFAULT_STORAGE,
        STORAGE_ENV,
        check_shared,
        create_engine,
        in_memory,
        open_storage,
        resolve_storage_url,
    )


__getattr__ = lazy(__name__, _EXPORTS)
