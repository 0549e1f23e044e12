"""A stand-in engine for host-side tests: the control API the real ones serve (GET answers its pid and
``ready``), started as the activation runtime starts engines (its control file's path in
``COLDSNAP_CONTROL_FILE``). Arguments: the control file; a flag file whose presence makes the API stall,
as a busy or hung engine's does ("" for none); a serving port it listens on ("0" for none)."""

ENGINE = r"""
import http.server, json, os, socket, sys, time
ctl, stall, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if port:
    serving = socket.socket(); serving.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    serving.bind(("127.0.0.1", port)); serving.listen()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if stall and os.path.exists(stall):
            time.sleep(60)
        body = json.dumps({"ok": True, "pid": os.getpid(), "state": "ready"}).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
srv = http.server.HTTPServer(("127.0.0.1", 0), H)
tmp = ctl + ".tmp"
json.dump({"port": srv.server_address[1], "token": "t" * 64, "pid": os.getpid()}, open(tmp, "w"))
os.rename(tmp, ctl)
srv.serve_forever()
"""


def start_engine(workload_dir, worker: str = "w0", *, port: int = 0, stall: str = ""):
    """Start the stand-in as worker ``worker`` of the workload directory (its control file there, named in
    its environment as the activation runtime names it), reaped in the background as the unit keeper
    reaps engines; returns the process once its control file exists."""
    import os
    import subprocess
    import sys
    import threading
    import time

    from ansible_collections.coldsnap.fleet.plugins.module_utils.formats import engine_control as ec

    control = workload_dir / ec.CONTROL_FILE_NAME.format(worker=worker)
    proc = subprocess.Popen([sys.executable, "-c", ENGINE, str(control), stall, str(port)],
                            env={**os.environ, ec.ENV_CONTROL_FILE: str(control)}, stderr=subprocess.DEVNULL)
    threading.Thread(target=proc.wait, daemon=True).start()
    deadline = time.monotonic() + 30
    while not control.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not control.exists():
        proc.kill()
        raise AssertionError(f"the stand-in engine wrote no control file {control}")
    return proc
