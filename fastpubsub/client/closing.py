"""`with` and `async with` for the SDK's objects: leaving the block closes them."""

from __future__ import annotations

from typing import Self


class Closing:
    """Leaving `with` calls close()."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncClosing:
    """Leaving `async with` awaits aclose()."""

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
