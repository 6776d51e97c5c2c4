from collections.abc import Callable
from typing import Any

class Closing:
    @property
    def closes(self) -> int: ...
    def __init__(
        self,
        *,
        monitor: Any,
        busy: Any,
        flight: Any,
        tally: Any,
        stop: Any,
        record: list[Any],
        send: Any,
        recv: Any,
        request: Any,
        timeline: Any,
        monitoring: Any,
        kind: str,
        kind_code: int,
        magic: int,
        timeout: float | None,
        disagreed: Callable[..., Any],
        nothing: int,
        fold_every: int,
        mask: int,
    ) -> None: ...
    def close(self, collectives: Any, kind: str, fingerprint: int, describe: Callable[[], Any]) -> bool: ...

class StepState:
    learning: bool
    @property
    def record(self) -> list[Any]: ...
    @property
    def kinds(self) -> dict[str, int]: ...
    @property
    def limit(self) -> int: ...
    @property
    def coder(self) -> Callable[[dict[str, int], str], int]: ...
    def __init__(self, limit: int, coder: Callable[[dict[str, int], str], int]) -> None: ...
    def defer(self, seq: int, kind: str, fingerprint: int) -> bool: ...
    def record_code(self) -> int: ...
