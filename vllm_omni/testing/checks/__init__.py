"""What the tests and checks compare against or drive the engine with: the stock diffusers pipelines, step mode
scripted, edit inputs, the family table of docs/models.md, and engines whose batches finish when a test says."""
