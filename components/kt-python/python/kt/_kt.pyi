"""Type stubs of the native half of kt (src/lib.rs). Use the `kt` module:
it checks arguments and lends memory; these functions expect what it
passes."""

from typing import Any, Dict, List, Optional, Tuple

CONTROL_VERSION: int

Described = Tuple[str, str, List[int], str, Tuple[str, List[str]]]

def configure(
    metadata_url: Optional[str] = None,
    token: Optional[str] = None,
    token_file: Optional[str] = None,
    agent_socket: Optional[str] = None,
    streams: Optional[int] = None,
) -> None: ...
def settings() -> Dict[str, Any]: ...
def put_path(
    key: str,
    src: str,
    locale: str,
    lifespan: str,
    ttl: Optional[str] = None,
    service: Optional[str] = None,
    progress: bool = False,
) -> Dict[str, Any]: ...
def get_path(
    key: str,
    dest: str,
    delete: bool = False,
    broadcast: Optional[str] = None,
    progress: bool = False,
) -> Any: ...
def ls(prefix: str = "") -> List[Dict[str, Any]]: ...
def rm(key: str, recursive: bool = False) -> List[str]: ...
def teardown(service: str) -> Dict[str, List[str]]: ...
def put_tensors(
    key: str,
    tensors: List[Described],
    lifespan: str,
    ttl: Optional[str] = None,
    service: Optional[str] = None,
    broadcast: Optional[str] = None,
) -> Dict[str, Any]: ...
def get_tensors(
    key: str,
    tensors: List[Described],
    broadcast: Optional[str] = None,
    packed: Optional[bool] = None,
    keep_mapped: bool = False,
) -> Dict[str, Any]: ...
def drop_tensors(key: str) -> None: ...
def shm_dir() -> str: ...
def dtypes() -> Dict[str, int]: ...
