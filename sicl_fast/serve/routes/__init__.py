"""The server's routes, one module per concern. Each module holds an APIRouter `router` (behind the API key) and
`BODIES`, the pydantic models of the JSON bodies its routes read (for the OpenAPI document); app.py includes
every module listed in its ROUTES. A route reads its body with dispatch.read_call, runs its engine work with
dispatch.run_job, raises errors.ServeHTTPError or a SiclError for what is wrong, and notes what its log line
should say with metrics.note.

    info.py          GET /health (no key: `public`), GET /v1/models, GET /metrics
    calibration.py   POST /v1/proxy, POST /v1/calibrate
    chat.py          POST /v1/chat/completions (OpenAI Chat Completions over a calibrated few-shot conversation)
"""
