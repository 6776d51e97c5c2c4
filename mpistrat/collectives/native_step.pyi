from collections.abc import Callable
from typing import Any

class Marks:
    kind: str
    start: float | None
    deadline: float | None
    polled: bool
    thread: int | None
    last_thread: int | None
    last: tuple[str, int, float] | None
    agreed: float | None
    completed: int
    handshakes: int
    def __init__(self) -> None: ...

class Closing:
    @property
    def closes(self) -> int: ...
    def __init__(
        self,
        *,
        marks: Marks,
        step: StepState,
        append: Callable[[list[Any]], None],
        start: Callable[[], None],
        wait: Callable[[], Any],
        file: Callable[[int, int], None],
        reached: Callable[[], None],
        disagreed: Callable[..., Any],
        send: Any,
        recv: Any,
        kind: str,
        kind_code: int,
        magic: int,
        timeout: float | None,
        nothing: int,
        mask: int,
    ) -> None: ...
    def close(
        self,
        collectives: Any,
        kind: str,
        seq: int,
        fingerprint: int,
        describe: Callable[[], Any],
        requested: bool,
        outgoing: tuple[int, int],
    ) -> bool: ...

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
