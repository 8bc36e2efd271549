"""Files of an artefact: atomic writes and checksums.

Every file is written atomically: to a hidden temporary in the same folder, flushed and fsynced,
then `os.replace`d into place (see `staged_writes`). A calibration interrupted while it writes leaves
the previous artefacts as they were and no half-written file under an artefact's name.
"""
from __future__ import annotations

import hashlib
import os
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def sha256_file(path: Path | str) -> str:
    """One checksum function for every artefact file (calibration.json records them)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


TMP_MARK = ".tmp-"            # temporaries are named ".<name>.tmp-<pid>-<hex>": hidden, never an artefact


class StagedWrites:
    """Files written to temporaries in one folder, put in place together by `commit`.

    `open(name)` gives a file object on a fresh temporary (np.savez, joblib.dump and json.dump all
    take file objects, so no writer appends its own suffix to the name); `path(name)` is where that
    temporary lies (e.g. to checksum it before it is committed). `commit` fsyncs and `os.replace`s
    them in the order they were opened; `discard` removes them.
    """

    def __init__(self, folder: Path | str):
        self.folder = Path(folder)
        self._tmp: dict[str, Path] = {}

    def path(self, name: str) -> Path:
        return self._tmp[name]

    def __contains__(self, name: str) -> bool:
        return name in self._tmp

    @contextmanager
    def open(self, name: str, mode: str = "wb", encoding: str | None = None):
        if name in self._tmp:
            raise ValueError(f"{name} is already staged")
        if "w" not in mode:
            raise ValueError(f"staged files are written, not opened with mode {mode!r}")
        tmp = self.folder / f".{name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._tmp[name] = tmp
        with open(tmp, mode.replace("w", "x"), encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())

    def commit(self) -> None:
        for name, tmp in list(self._tmp.items()):
            os.replace(tmp, self.folder / name)
            del self._tmp[name]
        _fsync_dir(self.folder)

    def discard(self) -> None:
        for tmp in self._tmp.values():
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass
        self._tmp.clear()


@contextmanager
def staged_writes(folder: Path | str) -> Iterator[StagedWrites]:
    """Stage several files; on a clean exit replace them all (in order), on any error remove them.

        with staged_writes(folder) as stage:
            with stage.open("router.npz") as f:
                np.savez(f, **arrays)
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(folder)
    stage = StagedWrites(folder)
    try:
        yield stage
    except BaseException:            # KeyboardInterrupt too: never leave a temporary behind
        stage.discard()
        raise
    try:
        stage.commit()
    except BaseException:
        stage.discard()
        raise


@contextmanager
def atomic_write(path: Path | str, mode: str = "wb", encoding: str | None = None):
    """Write one file atomically: `with atomic_write(p, "w", encoding="utf-8") as f: f.write(...)`."""
    path = Path(path)
    with staged_writes(path.parent) as stage:
        with stage.open(path.name, mode, encoding) as f:
            yield f


def remove_stale_temporaries(folder: Path | str) -> list[Path]:
    """Delete temporaries left by writers that were killed (their process is gone); return them.

    A temporary of a live process (e.g. another calibration writing here now) is left alone.
    """
    removed = []
    for tmp in Path(folder).glob(f".*{TMP_MARK}*"):
        pid = tmp.name.rsplit(TMP_MARK, 1)[-1].split("-", 1)[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            tmp.unlink()
            removed.append(tmp)
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid() or os.name == "nt":   # Windows' os.kill(pid, 0) would end the process
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True                      # exists but not ours, or we cannot tell: keep its file
    return True


def _fsync_dir(folder: Path) -> None:
    """Make the renames durable where the OS allows it (best effort; not on Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
