"""Deployment: docker-compose.yml, the images and the container health probe."""
