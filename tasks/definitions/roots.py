"""Which storage roots a pipeline may take: never the filesystem's root or a system folder (a pipeline rooted at `/`
writes `/runs`, `/models`, `/raw`), and a relative root climbs at most one folder above its config's (``../storage``
beside a pipelines folder)."""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

# Folders of the operating system: neither a storage root nor a place for one.
SYSTEM_FOLDERS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/run", "/sbin", "/sys", "/usr")
# Top-level folders that hold others' files: a root may live inside them, never be one.
SHARED_TOP_FOLDERS = ("/home", "/mnt", "/media", "/opt", "/root", "/srv", "/tmp", "/var")


def local_root_problem(root: str) -> str | None:
    """Why an absolute local storage root (a path or file:// URI) is refused, or None."""
    if "://" in root and not root.startswith("file://"):
        return None
    path = PurePosixPath(os.path.normpath(root.removeprefix("file://") or "/"))
    if not path.is_absolute():
        return None
    if str(path) == "/":
        return (f"storage_root '{root}' is the filesystem's root: runs/, models/ and raw/ would be written at the top "
                "of the machine; give a folder of the pipeline's own (e.g. /data/stagewise) or an s3:// URI")
    for folder in SYSTEM_FOLDERS:
        if path == PurePosixPath(folder) or PurePosixPath(folder) in path.parents:
            return (f"storage_root '{root}' is inside the system folder {folder}; give a folder of the pipeline's own "
                    "(e.g. /data/stagewise) or an s3:// URI")
    if str(path) in SHARED_TOP_FOLDERS:
        return (f"storage_root '{root}' is the shared folder {path} itself; give a folder of the pipeline's own inside "
                f"it (e.g. {path}/stagewise)")
    return None


def relative_root_problem(root: str, config_folder: Path) -> str | None:
    """Why a relative storage root is refused (it climbs more than one folder above its config's), or None."""
    depth, climbs = 0, 0
    for part in PurePosixPath(root).parts:
        depth += -1 if part == ".." else 0 if part == "." else 1
        climbs = max(climbs, -depth)
    if climbs <= 1:
        return None
    return (f"storage_root '{root}' climbs {climbs} folders above the config's folder {config_folder} (to "
            f"{(config_folder / root).resolve()}); a relative root may go up one (../storage); give an absolute "
            "folder or an s3:// URI instead")


def nearest_existing(path: Path) -> Path:
    """``path`` itself, or where it does not exist yet the nearest folder above it that does (the one a run's first
    write creates it in)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def unwritable_problem(root: Path) -> str | None:
    """Why this user could not create and write files under the local folder ``root``, or None. Probed with
    os.access, which knows permission bits, ACLs and read-only mounts, without writing anything."""
    found = nearest_existing(root)
    where = f"{found}" if found == root else f"{found} (the nearest folder of it that exists; runs would create the rest)"
    if not found.is_dir():
        return f"{where} is a file, not a folder"
    if not os.access(found, os.W_OK | os.X_OK):
        read_only = os.statvfs(found).f_flag & os.ST_RDONLY
        return (f"{where} is on a read-only filesystem" if read_only else
                f"{where} is not writable by this user (uid {os.geteuid()})")
    return None
