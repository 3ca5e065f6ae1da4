"""What the store's own upkeep (retention, packing) needs of its folder index.

The index (``objectstore.FolderIndex``) answers tansu's listings from memory, so every
change the store makes to its objects behind tansu's back goes through it, or a listing
would show what is no longer there.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol


class Listing(Protocol):
    def writing(self, path: Path, *, forget: bool) -> AbstractContextManager[None]:
        """Around a change to ``path``: listings read from disk meanwhile are not kept."""
        ...

    def written(self, bucket_dir: Path, path: Path) -> None:
        """``path`` was just written: listings show it as it is now."""
        ...

    def removed(self, bucket_dir: Path, paths: Collection[Path], remove: Callable[[], None]) -> None:
        """``remove`` deletes ``paths``; listings stop showing them once it has."""
        ...

    def rewritten(
        self, bucket_dir: Path, kept: Path, gone: Collection[Path], rewrite: Callable[[], None]
    ) -> None:
        """``rewrite`` deletes ``gone`` and rewrites ``kept``; a listing shows the objects
        as they were or as they are after, never a mix."""
        ...
