"""OpenAI's Images API: generations, edits, and the image files and urls they hand out."""
