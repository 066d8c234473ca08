"""OpenAI's Videos API: video jobs, their store and their MP4 and PNG files."""
