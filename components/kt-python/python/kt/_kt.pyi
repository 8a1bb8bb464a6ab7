"""Type stubs of the native half of kt (src/lib.rs). Use the `kt` module:
it checks arguments and lends memory; these functions expect what it
passes. Records cross as tuples in the field order of the `kt` dataclass
that wraps them."""

from typing import Any, Callable, Dict, List, Optional, Tuple, Union

CONTROL_VERSION: int

Described = Tuple[str, str, List[int], str, Tuple[str, List[str]]]

# f(bytes_done, bytes_total, files_total, finished)
ProgressFn = Callable[[int, int, int, bool], None]

# kt.PutResult: key, files, bytes_sent, bytes_skipped, unchanged, locale,
# version, seconds
PutTuple = Tuple[str, int, int, int, bool, Any, Optional[str], float]

# kt.GetResult: key, dest, files, bytes_sent, bytes_skipped, seconds, group,
# rank, parents, relayed
GetTuple = Tuple[str, str, int, int, int, float, Optional[str], Optional[int], List[int],
                 Optional[int]]

# A key's record: locale, holder, is_dir, size, files, version, lifespan,
# service, created_ms, updated_ms, expires_ms, tensors
RecordTuple = Tuple[Any, str, bool, int, int, str, Any, str, int, int, Optional[int], bool]

# kt.Settings: metadata_url, agent_socket, streams, deadline, kube, shm_dir
SettingsTuple = Tuple[str, str, int, float, bool, str]

def configure(
    metadata_url: Optional[str] = None,
    token: Optional[str] = None,
    token_file: Optional[str] = None,
    agent_socket: Optional[str] = None,
    streams: Optional[int] = None,
    deadline: Optional[float] = None,
    kube: Optional[bool] = None,
    kubeconfig: Optional[str] = None,
    context: Optional[str] = None,
    namespace: Optional[str] = None,
) -> None: ...
def settings() -> SettingsTuple: ...
def announce_trace(verbose: bool) -> None: ...
def outside() -> bool: ...
def put_path(
    key: str,
    src: str,
    locale: str,
    lifespan: Optional[str] = None,
    ttl: Optional[str] = None,
    service: Optional[str] = None,
    bar: bool = False,
    progress: Optional[ProgressFn] = None,
    timeout: Optional[float] = None,
) -> PutTuple: ...
def get_path(
    key: str,
    dest: str,
    delete: bool = False,
    bar: bool = False,
    progress: Optional[ProgressFn] = None,
    timeout: Optional[float] = None,
    broadcast: bool = False,
    group_id: Optional[str] = None,
    window_secs: Optional[float] = None,
    fanout: Optional[int] = None,
) -> GetTuple: ...
def get_prefix(
    prefix: str, dest: str, delete: bool = False, timeout: Optional[float] = None
) -> List[GetTuple]: ...
def ls(
    prefix: str = "", timeout: Optional[float] = None
) -> List[Tuple[str, str, bool, Optional[RecordTuple]]]: ...
def rm(key: str, recursive: bool = False, timeout: Optional[float] = None) -> List[str]: ...
def datasets_call(
    op: str, name: Optional[str], spec: Optional[str], manifest: Optional[str],
    wait: Optional[str], timeout: float, kubeconfig: Optional[str], context: Optional[str],
    namespace: Optional[str],
) -> str: ...
def teardown(service: str, timeout: Optional[float] = None) -> Tuple[List[str], List[str]]: ...
def put_tensors(
    key: str,
    tensors: List[Described],
    lifespan: Optional[str] = None,
    ttl: Optional[str] = None,
    service: Optional[str] = None,
    broadcast: Optional[str] = None,
) -> Dict[str, Any]: ...
def get_tensors(
    key: str,
    # many None: the destination's tensors; "list"/"by_rank": (rank, tensor)
    tensors: Union[List[Described], List[Tuple[int, Described]]],
    broadcast: Optional[str] = None,
    packed: Optional[bool] = None,
    keep_mapped: bool = False,
    reduce: Optional[str] = None,
    many: Optional[str] = None,
) -> Dict[str, Any]: ...
def drop_tensors(key: str) -> None: ...
def shm_dir() -> str: ...
def dtypes() -> Dict[str, int]: ...

# kt.Dataset (stream.py): (position, path below the prefix, local path, size)
class ShareStream:
    def __init__(
        self, prefix: str, rank: int, world: int, epoch: int = 0, shuffle: bool = False,
        budget: int = ..., start: int = 0, ahead: int = 4, dir: Optional[str] = None,
        timeout: Optional[float] = None,
    ) -> None: ...
    def next_file(self) -> Optional[Tuple[int, str, str, int]]: ...
    def release(self) -> None: ...
    @property
    def position(self) -> int: ...
    @property
    def share(self) -> List[Tuple[str, int]]: ...
    def held(self) -> Tuple[int, int, int]: ...
    @property
    def dir(self) -> str: ...
def get_share(
    prefix: str, dest: str, rank: int, world: int, epoch: int = 0, shuffle: bool = False,
    timeout: Optional[float] = None,
) -> List[Tuple[str, str, int]]: ...
