"""Hostile programs for the code verifier (rl_jax.rewards code), each a completion for
one problem: `f(2)` must return EXPECT (`ANSWER`).

A program returns EXPECT only if its attack worked (it read a secret file holding the
value, reached a listening socket, wrote outside its directory, signalled another
process...), so an escape shows as a reward above zero; the caller also checks the
marker directory, the listener and its own survival. The rest (loops, bombs, memory,
output, exits, spoofs) must simply score 0 within the time limit.

`corpus(ctx, full=False)`: one or two programs of each family (the test suite);
`full=True`: every variant (benchmarks/code_verifier.py, over 200 programs).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

EXPECT = 7777771
ANSWER = json.dumps({"entry_point": "f", "tests": [f"assert f(2) == {EXPECT}"]})


@dataclass(frozen=True)
class Context:
    marker_dir: str  # outside any sandbox: nothing may appear here
    secret: str  # a file outside the sandbox holding EXPECT
    port: int  # a TCP listener on 127.0.0.1 that must see no connection
    pid: int  # the process running the verifier (the trainer): must survive


def _fn(body: str, pre: str = "") -> str:
    """A program whose f(n) runs `body` (indented) and then returns EXPECT."""
    lines = "\n".join("    " + line for line in body.strip().splitlines())
    return f"{pre}\ndef f(n):\n{lines}\n    return {EXPECT}\n"


def _top(body: str, value: int = EXPECT) -> str:
    """A program running `body` at import, then defining f(n) -> `value`."""
    return f"{body.strip()}\ndef f(n):\n    return {value}\n"


def _fn0(body: str) -> str:
    """A program whose f(n) runs `body` and then returns a wrong answer."""
    lines = "\n".join("    " + line for line in body.strip().splitlines())
    return f"def f(n):\n{lines}\n    return 0\n"


def families(c: Context) -> dict[str, list[str]]:
    m = f"{c.marker_dir}/m"
    s = c.secret
    read_secret = [
        f"x = open({s!r}).read()",
        f"import io\nx = io.open({s!r}).read()",
        f"import os\nfd = os.open({s!r}, os.O_RDONLY)\nx = os.read(fd, 100).decode()",
        f"import pathlib\nx = pathlib.Path({s!r}).read_text()",
        f"import codecs\nx = codecs.open({s!r}).read()",
        f"import linecache\nx = linecache.getline({s!r}, 1)\nassert x",
        f"import shutil\nshutil.copy({s!r}, 'c')\nx = open('c').read()",
        f"import os\nos.symlink({s!r}, 'l')\nx = open('l').read()",
        f"import os\nos.link({s!r}, 'l')\nx = open('l').read()",
        f"x = open('/proc/self/root' + {s!r}).read()",
        f"x = open('../' * 30 + {s!r}.lstrip('/')).read()",
        "import os\nd = os.open({d!r}, os.O_RDONLY)\nfd = os.open({b!r}, os.O_RDONLY, dir_fd=d)\n"
        "x = os.read(fd, 100).decode()".format(d=s.rsplit("/", 1)[0], b=s.rsplit("/", 1)[1]),
        f"import mmap, os\nfd = os.open({s!r}, os.O_RDONLY)\n"
        "x = mmap.mmap(fd, 0, prot=1)[:].decode()",
        f"import runpy\nx = str(runpy.run_path({s!r}).get('x', ''))",
        f"import tarfile\ntarfile.open({s!r})\nx = ''",
        f"import sqlite3\nsqlite3.connect({s!r})\nx = ''",
        f"import os\nos.chdir({s.rsplit('/', 1)[0]!r})\nx = open({s.rsplit('/', 1)[1]!r}).read()",
        f"import subprocess\nx = subprocess.check_output(['cat', {s!r}]).decode()",
        f"import os\nx = os.popen('cat ' + {s!r}).read()",
        "import os\nx = open(f'/proc/{os.getppid()}/cmdline').read()\nx = x if '7777' in x else ''",
        "import os\nx = open(f'/proc/{os.getppid()}/environ').read()",
        "import os\nmem = open(f'/proc/{os.getppid()}/mem', 'rb')\nx = ''",
        "x = open('/etc/passwd').read()",
        "x = open('/etc/hostname').read()",
        "import os\nx = str(os.listdir('/'))",
        "import glob\nx = str(glob.glob('/etc/*'))",
    ]
    write_out = [
        f"open({m!r}, 'w').write('x')",
        f"import os\nfd = os.open({m!r}, os.O_WRONLY | os.O_CREAT)\nos.write(fd, b'x')",
        f"import pathlib\npathlib.Path({m!r}).write_text('x')",
        f"import os\nos.mkdir({m!r})",
        f"import shutil\nopen('a', 'w').write('x')\nshutil.copy('a', {m!r})",
        f"import os\nopen('a', 'w').write('x')\nos.rename('a', {m!r})",
        f"open('../' * 30 + {m!r}.lstrip('/'), 'w').write('x')",
        f"import os\nos.system('touch {m}')",
        "open('/tmp/rl_jax_hostile_marker', 'w').write('x')",
        "import tempfile\ntempfile.NamedTemporaryFile(dir='/tmp', delete=False).write(b'x')",
    ]
    processes = [
        "import os\nassert os.system('true') == 0",
        "import os\npid = os.fork()\nif pid == 0:\n    os._exit(0)",
        "import os\nwhile True:\n    os.fork()",
        "import subprocess\nsubprocess.run(['true'], check=True)",
        "import os\nos.popen('true').read()",
        "import os\nos.execv('/bin/sh', ['sh', '-c', 'true'])",
        "import os\nos.posix_spawn('/bin/true', ['true'], {})",
        "import os\nos.spawnv(os.P_WAIT, '/bin/true', ['true'])",
        "import pty\npty.fork()",
        "import os\nos.forkpty()",
        "import multiprocessing\np = multiprocessing.Process(target=print)\np.start()",
        "__import__('os').system('true')",
        "getattr(__import__('o' + 's'), 'sys' + 'tem')('true')",
        "import importlib\nimportlib.import_module('subprocess').run(['true'])",
        "eval(\"__import__('os').system('true')\")",
        "exec(\"import os; os.system('true')\")",
        "import posix\nposix.system('true')",
        "import ctypes\nctypes.CDLL(None).system(b'true')",
        "import _ctypes",
        "import _posixsubprocess",
        "import os\nos.kill(os.getppid(), 0)",
        "import os\nos.kill(-1, 0)",
        f"import os\nos.kill({c.pid}, 0)",
        "import os\nos.killpg(os.getpgid(os.getppid()), 0)",
        "import os\nos.kill(os.getppid(), 9)",
        "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (10**6, 10**6))",
    ]
    network = [
        f"import socket\nsocket.create_connection(('127.0.0.1', {c.port}), timeout=1)",
        f"import socket\ns = socket.socket()\ns.connect(('127.0.0.1', {c.port}))",
        f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {c.port}))",
        f"import urllib.request\nurllib.request.urlopen('http://127.0.0.1:{c.port}', timeout=1)",
        "import http.client\n"
        f"http.client.HTTPConnection('127.0.0.1', {c.port}).request('GET', '/')",
        "import socket\nsocket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', "
        f"('127.0.0.1', {c.port}))",
        "import socket\nsocket.socketpair()",
        "import socket\nsocket.getaddrinfo('localhost', 80)",
        f"import asyncio\nasyncio.run(asyncio.open_connection('127.0.0.1', {c.port}))",
    ]
    return {
        # Each attack at call time (in f) and at import (top level).
        "read_file": [w(b + "\nassert '7777771' in x") for b in read_secret for w in (_fn, _top)],
        "write_outside": [w(b) for b in write_out for w in (_fn, _top)],
        "process": [w(b) for b in processes for w in (_fn, _top)],
        "network": [w(b) for b in network for w in (_fn, _top)],
        **_contained(c),
    }


def _contained(c: Context) -> dict[str, list[str]]:
    """Attacks that cannot leak anything but must still end within the limit at 0."""
    loops = [
        "while True:\n    pass",
        "import itertools\nfor _ in itertools.count():\n    pass",
        "import time\ntime.sleep(10**6)",
        "import threading\nthreading.Event().wait()",
        "import signal\nsignal.pause()",
        "import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True:\n    pass",
        "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass",
        "import signal\nsignal.signal(signal.SIGALRM, lambda *a: None)\nsignal.alarm(1)\n"
        "while True:\n    pass",
        "import threading, time\nfor _ in range(8):\n    threading.Thread(target=lambda: "
        "[0 for _ in iter(int, 1)], daemon=True).start()\ntime.sleep(10**6)",
        "x = 10 ** 10 ** 8",
        "import os\nos.read(3, 1)",
    ]
    memory = [
        "x = [0] * 10**10",
        "x = 'x' * 10**10",
        "x = bytearray(2**40)",
        "x = []\nwhile True:\n    x.append(' ' * 10**6)",
        "import mmap\nm = mmap.mmap(-1, 2**40)",
        "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, "
        "args=(100,)).start()",
    ]
    output = [
        "while True:\n    print('x' * 10**5)",
        "import sys\nsys.stdout.write('x' * 10**9)",
        "import os\nwhile True:\n    os.write(1, b'x' * 10**6)",
        "import os\nwhile True:\n    os.write(2, b'x' * 10**6)",
        "f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * 10**6)",
        "for i in range(10**6):\n    open(f'f{i}', 'w').write('x' * 10**5)",
        "print('PASS')\nprint('All tests passed')",
    ]
    exits = [
        "import sys\nsys.exit(0)",
        "raise SystemExit(0)",
        "import os\nos._exit(0)",
        "import os\nos.abort()",
        "exit()",
        "raise KeyboardInterrupt",
        "import os\nos.close(4)",
        "import os\nos.write(4, b'garbage' * 100)",
        "import os\nos.write(4, (16).to_bytes(4, 'big') + b'{\"v\":true,\"r\":0}')",
        "import os\nos.write(4, (21).to_bytes(4, 'big') + b'{\"ok\":true,\"pass\":1}')",
        "import sys\nsys.setrecursionlimit(10**9)\ndef g(k):\n    return g(k + 1)\ng(0)",
        "def g(k):\n    return g(k + 1)\ng(0)",
        "eval('(' * 10**6 + ')' * 10**6)",
    ]
    spoofs = [
        "import builtins\nbuiltins.AssertionError = type('E', (BaseException,), {})",
        "import sys\nm = sys.modules['__main__']\nm.Server.answer = lambda self, v, extra='': "
        '\'{"v":true,"r":0}\'',
        "import sys\nm = sys.modules['__main__']\nm.Server.handle = lambda self, req: "
        '\'{"v":{"d":[]},"r":0}\'',
        "import sys\nm = sys.modules['__main__']\nm.to_json = lambda *a: None",
        "import gc\nfor o in gc.get_objects():\n    if isinstance(o, dict) and 'hook' in o:\n"
        "        o.clear()\nimport os\nos.system('true')",
        "import sys\nf0 = sys._getframe()\nwhile f0.f_back:\n    f0 = f0.f_back\n"
        "f0.f_globals['make_hook'] = None\nimport os\nos.system('true')",
        "import sys\nfor h in [o for o in __import__('gc').get_objects() if "
        "getattr(o, '__name__', '') == 'hook']:\n    h.__code__ = (lambda e, a: None).__code__\n"
        "import os\nos.system('true')",
        "import sys\nfor h in [o for o in __import__('gc').get_objects() if "
        "getattr(o, '__name__', '') == 'hook']:\n    h.__defaults__ = None\n"
        "import os\nos.system('true')",
        "import atexit\natexit.register(lambda: __import__('os').system('true'))",
    ]
    equal_always = "class A:\n    def __eq__(self, o):\n        return True\n    __hash__ = None\n"
    results = [
        equal_always + "def f(n):\n    return A()",
        "class I(int):\n    def __eq__(self, o):\n        return True\ndef f(n):\n    return I(0)",
        "class S(str):\n    def __eq__(self, o):\n        return True\ndef f(n):\n    return S('')",
        "def f(n):\n    return float('nan')",
        "def f(n):\n    return f",
        "def f(n):\n    a = []\n    for _ in range(10**5):\n        a = [a]\n    return a",
        "def f(n):\n    a = []\n    a.append(a)\n    return a",
        "import gc\ndef f(n):\n    for o in gc.get_objects():\n        if isinstance(o, str) and "
        "'7777' in o:\n            return int(o.split('== ')[-1])\n    return 0",
        "import sys\ndef f(n):\n    return int(next(a for a in sys.argv if '7777' in a))",
        "import os\ndef f(n):\n    return int(next(v for v in os.environ.values() if '7777' in v))",
        "import os\ndef f(n):\n    data = os.read(3, 1 << 16)\n    return int(data) if data else 0",
    ]
    wrap = [_fn0(b) for b in loops + memory + output + exits + spoofs]
    wrap += [_top(b, 0) for b in loops[:3] + memory[:2] + output[:3] + exits + spoofs]
    return {"contained": wrap, "results": results}


def corpus(c: Context, *, full: bool = False) -> list[tuple[str, str]]:
    """(family, program) pairs: every variant when `full`, else a representative few."""
    out = []
    for fam, progs in families(c).items():
        chosen = progs if full else progs[:: max(1, len(progs) // 10)]
        out += [(fam, p) for p in chosen]
    return out
