"""The Files and Batch API's routes (files.py, batches.py): upload, list, read and delete files;
create, list, read and cancel batches. Without --state-dir they answer that they need one."""

from starlette.concurrency import run_in_threadpool
from starlette.responses import FileResponse, JSONResponse
from starlette.routing import Route

from flexh2o.server.errors import bad_request
from flexh2o.server.routes import handled, read_json

LIST_LIMIT = 100  # batches per page at most, as OpenAI's


def batch_routes(state) -> list:
    def stores():
        if state.batches is None:
            raise bad_request("this server keeps no files or batches: start it with --state-dir DIR (where they are "
                              "kept, and from where a batch resumes after a restart)")
        return state.files, state.batches

    async def upload(request, note):
        files, _ = stores()
        async with request.form(max_files=1, max_fields=8) as form:
            purpose, upload = form.get("purpose"), form.get("file")
            if not isinstance(purpose, str):
                raise bad_request("give the file's purpose (batch) as the form field \"purpose\"", "purpose")
            if upload is None or isinstance(upload, str):
                raise bad_request("give the file as the form field \"file\" (multipart/form-data)", "file")
            found = await run_in_threadpool(files.create, upload.file, upload.filename or "upload.jsonl", purpose)
        note.update(id=found["id"], bytes=found["bytes"])
        return JSONResponse(found)

    async def list_files(request, note):
        files, _ = stores()
        purpose = request.query_params.get("purpose")
        return JSONResponse({"object": "list", "data": files.list(purpose), "has_more": False})

    async def get_file(request, note):
        files, _ = stores()
        return JSONResponse(files.get(request.path_params["file_id"]))

    async def file_content(request, note):
        files, _ = stores()
        return FileResponse(files.content_path(request.path_params["file_id"]), media_type="application/jsonl")

    async def delete_file(request, note):
        files, batches = stores()
        file_id = request.path_params["file_id"]
        files.get(file_id)
        user = batches.uses(file_id)
        if user is not None:
            raise bad_request(f"the file {file_id} is the input of batch {user}, which has not ended: cancel it "
                              "first", "file_id")
        return JSONResponse(files.delete(file_id))

    async def create_batch(request, note):
        _, batches = stores()
        state.check_ready()
        created = await run_in_threadpool(batches.create, await read_json(request))
        note["id"] = created["id"]
        return JSONResponse(created)

    async def list_batches(request, note):
        _, batches = stores()
        try:
            limit = int(request.query_params.get("limit", 20))
        except ValueError:
            limit = 0
        if not 1 <= limit <= LIST_LIMIT:
            raise bad_request(f"limit must be a whole number from 1 to {LIST_LIMIT}", "limit")
        found = batches.list()
        after = request.query_params.get("after")
        if after is not None:
            ids = [b.id for b in found]
            found = found[ids.index(after) + 1:] if after in ids else []
        page = [batches.view(b) for b in found[:limit]]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(found) > limit})

    async def get_batch(request, note):
        _, batches = stores()
        return JSONResponse(batches.view(batches.get(request.path_params["batch_id"])))

    async def cancel_batch(request, note):
        _, batches = stores()
        return JSONResponse(await run_in_threadpool(batches.cancel, request.path_params["batch_id"]))

    table = [("/v1/files", upload, "POST"), ("/v1/files", list_files, "GET"),
             ("/v1/files/{file_id}", get_file, "GET"), ("/v1/files/{file_id}", delete_file, "DELETE"),
             ("/v1/files/{file_id}/content", file_content, "GET"), ("/v1/batches", create_batch, "POST"),
             ("/v1/batches", list_batches, "GET"), ("/v1/batches/{batch_id}", get_batch, "GET"),
             ("/v1/batches/{batch_id}/cancel", cancel_batch, "POST")]
    return [Route(path, handled(handler), methods=[method]) for path, handler, method in table]
