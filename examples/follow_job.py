"""Follow one job over the live socket from a script: a bearer token, no Origin header (a browser
always sends one; a script need not). Prints the job's progress and state until it ends.
Usage: python examples/follow_job.py http://127.0.0.1:8000 TOKEN JOB_ID"""
import json
import sys

from websockets.sync.client import connect

portal, token, job_id = sys.argv[1], sys.argv[2], int(sys.argv[3])
with connect(portal.replace("http", "ws", 1) + "/ws/live/", additional_headers={"Authorization": f"Bearer {token}"}) as socket:
    socket.send(json.dumps({"action": "subscribe_job", "job_id": job_id}))
    for event in map(json.loads, socket):
        if event["type"] == "progress":
            print(f"step {event['step']}/{event['total_steps']} loss {event['loss']}", flush=True)
        elif event["type"] in ("job_state", "error"):
            print(event.get("job", {}).get("state") or event["message"], flush=True)
            if event["type"] == "error" or event["job"]["state"] in ("succeeded", "failed", "cancelled"):
                break
